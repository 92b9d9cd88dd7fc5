"""The dataset page (`report.html`'s "Dataset" section and its queries): what was generated, checked
against the same figures computed independently in Python from the run's committed tables."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from batchgen.cli import main
from batchgen.report.queries import connect, run_query
from conftest import read_run_table, write_prompts

SCRIPT = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def dataset_run(tmp_path_factory, tiny_model_dir):
    """A run with every kind of row: repeated prompts (greedy, so repeated outputs), a script tag in a
    prompt, rows cut at various max_tokens, empty prompts and too-long prompts (errors)."""
    root = tmp_path_factory.mktemp("dataset-page")
    prompts = [f"question {i}: " + "why " * (i % 4) for i in range(14)]
    prompts += ["the same question", "the same question", "the same question", SCRIPT, "", "",
                "word " * 80, "word " * 90]
    ids = [f"d{i:02d}" for i in range(len(prompts))]
    inp = write_prompts(root / "in.parquet", prompts, ids=ids, max_tokens=[1 + i % 6 for i in range(len(prompts))])
    assert main(["generate", "--input", str(inp), "--output", str(root), "--run-id", "ds", "--model",
                 str(tiny_model_dir), "--max-model-len", "64", "--max-tokens", "6",
                 "--shard-size", "8", "--no-progress"]) == 0
    return root / "ds"


def quantile_cont(values, q):
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def test_the_queries_match_python(dataset_run):
    req = read_run_table(dataset_run, "requests").to_pylist()
    err = read_run_table(dataset_run, "errors").to_pylist()
    con = connect([str(dataset_run)])
    (s,) = run_query(con, "dataset_summary").to_pylist()
    lengths = [r["output_tokens"] for r in req]
    texts = Counter(r["text"] for r in req)
    assert (s["generated"], s["reused"], s["errors"]) == (len(req), 0, len(err)) and len(err) == 4
    assert s["finished_length"] == sum(r["finish_reason"] == "length" for r in req)
    assert s["finished_stop"] == sum(r["finish_reason"] == "stop" for r in req)
    assert s["length_share"] == pytest.approx(s["finished_length"] / len(req))
    assert s["output_tokens_mean"] == pytest.approx(sum(lengths) / len(lengths))
    for q in (50, 90, 99):
        assert s[f"output_tokens_p{q}"] == pytest.approx(quantile_cont(lengths, q / 100))
    assert s["output_tokens_max"] == max(lengths)
    dup = sum(n for n in texts.values() if n > 1)
    assert s["duplicated_rows"] == dup >= 3 and s["duplicate_share"] == pytest.approx(dup / len(req))

    ends = Counter([r["finish_reason"] for r in req] + ["error"] * len(err))
    got = {r["finish_reason"]: (r["n"], r["share"]) for r in run_query(con, "finish_reasons").to_pylist()}
    assert got == {k: (n, pytest.approx(n / sum(ends.values()))) for k, n in ends.items()}

    hist = run_query(con, "output_lengths").to_pylist()
    assert sum(h["n"] for h in hist) == len(req)
    for h in hist:
        assert h["n"] == sum(h["bin_start"] <= n < h["bin_start"] + h["bin_width"] for n in lengths)

    reasons = Counter((e["stage"], re.sub(r"[0-9]+", "N", e["error"])) for e in err)
    got = {(r["stage"], r["reason"]): (r["n"], r["example_ids"]) for r in run_query(con, "error_reasons").to_pylist()}
    assert {k: v[0] for k, v in got.items()} == dict(reasons) and len(reasons) == 2  # empty; too long (N tokens)
    for (stage, reason), (_, examples) in got.items():
        assert examples == sorted(e["id"] for e in err if (e["stage"], re.sub(r"[0-9]+", "N", e["error"])) == (stage, reason))

    dups = run_query(con, "duplicate_outputs").to_pylist()
    assert {(d["text"], d["n"]) for d in dups} == {(t, n) for t, n in texts.items() if n > 1}

    sample = run_query(con, "sample_rows").to_pylist()
    assert sorted(r["id"] for r in sample) == sorted(r["id"] for r in req)  # under 500: every row
    assert {r["id"]: r["prompt"] for r in sample}["d17"] == SCRIPT  # every row's prompt, by default


def test_the_page_shows_it_escaped(dataset_run, tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(dataset_run), "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "Dataset: what was generated" in page and "id=sample-rows" in page and "id='output-lengths'" in page
    assert SCRIPT not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # text, never markup
