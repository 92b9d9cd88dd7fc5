"""`batchgen estimate`: exact row and prompt-token counts (the run's own template and tokenizer), the
rows --reuse-from would copy, output tokens from max_tokens or from earlier runs, and rates from a probe
at the run's settings or from earlier runs' steps; what a real run then does agrees."""

import json

import pytest

from batchgen.cli import main
from batchgen.model import gemv

from conftest import cli_args, read_run_table, write_prompts

GEMV = gemv.load()


def estimate_json(capsys, *args) -> dict:
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_estimate_counts_what_the_run_then_does(tmp_path, tiny_model_dir, capsys):
    prompts = [f"question {i}: " + "why " * (i % 5) for i in range(10)] + ["   "]  # the last is an error row
    inp = write_prompts(tmp_path / "in.parquet", prompts, ids=[f"r{i}" for i in range(11)],
                        max_tokens=[3] * 5 + [None] * 6)
    args = cli_args(inp, tmp_path / "runs", tiny_model_dir, "a", "--n", "2")[1:]  # generate's flags
    est = estimate_json(capsys, *args, "--probe-rows", "3", "--probe-tokens", "4")
    assert (est["rows"], est["error_rows"], est["requests"], est["reusable"]) == (11, 1, 20, 0)
    assert est["max_output_tokens"] == est["output_tokens"] == 2 * (5 * 3 + 5 * 4)  # rows' max_tokens, else --max-tokens 4
    assert est["prefill_tok_per_s"] > 0 and est["decode_tok_per_s"] > 0 and est["seconds"] > est["load_s"] > 0
    assert est["cost"] is None and "probe of 3" in est["rate_basis"]

    assert main(["generate", *args]) == 0
    capsys.readouterr()
    req = read_run_table(tmp_path / "runs" / "a", "requests").to_pylist()
    assert sum(r["prompt_tokens"] for r in req) == est["prompt_tokens"]  # exact: the run's own tokens
    assert sum(r["output_tokens"] for r in req) <= est["max_output_tokens"]

    # from the run just made: its mean output a row, and (no probe) its steps' rates; a price gives a cost
    est2 = estimate_json(capsys, *args, "--history", str(tmp_path / "runs" / "a"), "--no-probe",
                         "--price-per-hour", "2.5")
    mean = sum(r["output_tokens"] for r in req) / len(req)
    assert "mean of" in est2["output_basis"] and est2["rate_basis"] == "the --history runs' steps"
    assert est2["output_tokens"] == 2 * (5 * min(3, round(mean)) + 5 * min(4, round(mean)))
    assert est2["cost"] == pytest.approx(est2["seconds"] / 3600 * 2.5)

    out = main(["estimate", *args])
    text = capsys.readouterr().out
    assert out == 0 and text.startswith("rows: 11 (1 would be errors before generation); requests: 20")


@pytest.mark.needs(f"gemv kernel unavailable: {GEMV}" if isinstance(GEMV, str) else None, "BATCHGEN_REQUIRE_KERNELS")
def test_rows_an_earlier_run_answered_are_counted_as_reusable(tmp_path, tiny_model_dir, capsys):
    ids = [f"r{i}" for i in range(8)]
    texts = [f"question {i}" for i in range(8)]
    first = write_prompts(tmp_path / "first.parquet", texts[:5], ids=ids[:5])
    grown = write_prompts(tmp_path / "grown.parquet", texts, ids=ids)
    assert main(cli_args(first, tmp_path / "runs", tiny_model_dir, "night1")) == 0
    capsys.readouterr()
    est = estimate_json(capsys, *cli_args(grown, tmp_path / "runs", tiny_model_dir, "night2")[1:],
                        "--reuse-from", str(tmp_path / "runs" / "night1"), "--probe-rows", "2")
    assert (est["requests"], est["reusable"]) == (8, 5)
    assert est["max_output_tokens"] == 3 * 4  # only the three new rows are generated


def test_estimate_without_rates_or_input_is_a_clear_error(tmp_path, tiny_model_dir, capsys):
    inp = write_prompts(tmp_path / "in.parquet", ["x"])
    assert main(["estimate", *cli_args(inp, tmp_path, tiny_model_dir, "e")[1:], "--no-probe"]) == 2
    assert "no rates to estimate from" in capsys.readouterr().err
    assert main(["estimate", "--model", str(tiny_model_dir)]) == 2
    assert "no input: give --input PATH" in capsys.readouterr().err
