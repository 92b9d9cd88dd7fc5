"""`batchgen generate` end to end: the real model through the real CLI, and bad input."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.cli import main
from batchgen.data.writer import SCHEMAS

from conftest import REPO, read_run_table, write_prompts

METRICS_COLUMNS = {  # the contract in docs/METRICS.md
    "requests": ["id", "prompt_tokens", "output_tokens", "output_token_ids", "text", "finish_reason", "enqueue_t",
                 "schedule_t", "first_token_t", "last_token_t", "queue_s", "ttft_s", "prefill_s", "tpot_s", "e2e_s"],
    "errors": ["id", "error", "stage"],
    "tokens": ["request_id", "token_index", "step_id", "t", "itl_s", "context_len", "concurrency"],
    "steps": ["step_id", "start_t", "end_t", "num_running", "num_waiting", "num_prefill_tokens",
              "num_decode_tokens", "sum_context_len", "bytes_read"],
}


def read(run_dir, table):
    return read_run_table(run_dir, table)


def test_schema_has_every_metrics_column():
    for table, cols in METRICS_COLUMNS.items():
        assert set(cols) <= set(SCHEMAS[table].names), table


@pytest.mark.slow
def test_real_model_generate_through_the_cli(tmp_path, seed_prompts):
    src = pq.read_table(seed_prompts).slice(0, 6)
    inp = tmp_path / "in.parquet"
    pq.write_table(src.append_column("max_tokens", pa.array([12, 4, 12, 8, 1, 12], pa.int32())), inp)
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "batchgen.cli", "generate", "--input", str(inp), "--output", str(out),
                           "--run-id", "r1", "--max-num-seqs", "4", "--shard-size", "4", "--max-model-len", "512"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "6 rows -> 6 outputs, 0 errors, 2 shards" in proc.stdout
    run = out / "r1"
    assert (run / "_SUCCESS").is_file()
    req = read(run, "requests").to_pylist()
    assert sorted(r["id"] for r in req) == sorted(src.column("id").to_pylist())
    by_id = {r["id"]: r for r in req}
    assert by_id["seed_task_4"]["output_tokens"] == 1 and by_id["seed_task_4"]["tpot_s"] is None
    for r in req:
        assert r["output_tokens"] == len(r["output_token_ids"]) and r["text"] is not None
        assert r["finish_reason"] in ("stop", "length")
        assert r["queue_s"] >= 0 and r["ttft_s"] >= r["prefill_s"] > 0
    tokens = read(run, "tokens")
    assert tokens.num_rows == sum(r["output_tokens"] for r in req)
    for row in tokens.to_pylist():
        assert (row["itl_s"] is None) == (row["token_index"] == 0)
        assert row["token_id"] == by_id[row["request_id"]]["output_token_ids"][row["token_index"]]
    steps = read(run, "steps")
    assert steps.num_rows > 0 and set(METRICS_COLUMNS["steps"]) <= set(steps.column_names)
    conditions = json.loads((run / "run.json").read_text())["conditions"]
    assert conditions["engine"]["max_num_seqs"] == 4
    assert conditions["hardware"]["peak_read_bytes_per_s"] > 0


def generate(tmp_path, model, inp, *extra, run_id="r"):
    return main(["generate", "--input", *([str(i) for i in inp] if isinstance(inp, list) else [str(inp)]),
                 "--output", str(tmp_path / "runs"), "--run-id", run_id, "--model", str(model),
                 "--max-tokens", "3", "--max-model-len", "64", "--no-progress", *extra])


# ---- whole-input errors: one line naming the file and column, non-zero exit, nothing written ------

def _corrupt(p):
    p.write_bytes(b"this is not parquet at all")
    return p


@pytest.mark.parametrize("make_input, message", [
    (lambda p: pq.write_table(pa.table({"text": ["hi"]}), p) or p, "no 'prompt' or 'messages' column"),
    (lambda p: pq.write_table(pa.table({"prompt": [1, 2]}), p) or p, "column 'prompt' must be string, found int64"),
    (_corrupt, "not a readable Parquet file"),
    (lambda p: pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), p) or p, "the dataset has no rows"),
    (lambda p: write_prompts(p, ["a", "b", "c"], ids=["x", "y", "x"]), "column 'id' has duplicate values (e.g. 'x')"),
    (lambda p: p.parent / "missing.parquet", "no such file or directory"),
])
def test_whole_input_errors(tmp_path, tiny_model_dir, capsys, make_input, message):
    p = make_input(tmp_path / "in.parquet")
    assert generate(tmp_path, tiny_model_dir, p) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert message in err and str(p) in err  # what went wrong, and in which file
    assert not (tmp_path / "runs").exists()


def test_unwritable_output_is_refused_before_work(tmp_path, tiny_model_dir, capsys):
    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    (tmp_path / "runs").write_text("a file where the output root should be")
    assert generate(tmp_path, tiny_model_dir, inp) == 2
    assert "cannot be written" in capsys.readouterr().err


def test_bad_flag_values_are_rejected_by_validation(tmp_path, tiny_model_dir, capsys):
    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    assert generate(tmp_path, tiny_model_dir, inp, "--max-num-seqs", "0") == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# ---- row-level errors: the run goes on; every row ends in requests/ or errors/ ---------------------

def test_row_errors_are_rows_and_nothing_is_lost(tmp_path, tiny_model_dir):
    long_prompt = "word " * 200
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "id": ["ok", "empty", "null", "long", "neg", "nan-temp", "str-temp", "ok2"],
        "prompt": ["hello there", "   ", None, long_prompt, "fine", "fine", "fine", "another"],
        "max_tokens": [3, None, None, None, -1, None, None, 2],
        "temperature": [None, None, None, None, None, float("nan"), None, None],
    }), inp)
    assert generate(tmp_path, tiny_model_dir, inp, "--shard-size", "3") == 0
    run = tmp_path / "runs" / "r"
    errors = {r["id"]: r for r in read(run, "errors").to_pylist()}
    ok = {r["id"] for r in read(run, "requests").to_pylist()}
    assert ok == {"ok", "ok2", "str-temp"}
    assert set(errors) == {"empty", "null", "long", "neg", "nan-temp"}
    assert "prompt is empty" in errors["empty"]["error"] and "prompt is null" in errors["null"]["error"]
    assert "more than the 63 that fit" in errors["long"]["error"] and errors["long"]["stage"] == "tokenize"
    assert "max_tokens must be in [1, " in errors["neg"]["error"]
    assert "temperature must be a finite number" in errors["nan-temp"]["error"]
    assert (run / "_SUCCESS").is_file()


def test_string_temperature_column_is_a_row_error(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a b c", "d e f"], "temperature": ["0.5", "hot"]}), inp)
    assert generate(tmp_path, tiny_model_dir, inp) == 0
    errors = read(tmp_path / "runs" / "r", "errors").to_pylist()
    assert len(errors) == 2 and all("temperature must be a finite number" in e["error"] for e in errors)
    assert [e["id"] for e in errors] == ["0", "1"]  # ids default to the row number


def test_too_long_truncate_policy_keeps_the_end(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["word " * 200], ids=["long"])
    assert generate(tmp_path, tiny_model_dir, inp, "--too-long", "truncate", "--prompt-format", "raw") == 0
    (row,) = read(tmp_path / "runs" / "r", "requests").to_pylist()
    from batchgen.model.tokenizer import Tokenizer

    n = len(Tokenizer(tiny_model_dir).encode("word " * 200))
    assert row["prompt_tokens"] == 63 and row["prompt_truncated_from"] == n > 63


def test_messages_column_and_malformed_messages(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["good", "bad-json", "no-role", "empty"],
                             "messages": [json.dumps([{"role": "user", "content": "hi"}]), "{not json",
                                          json.dumps([{"content": "hi"}]), "[]"]}), inp)
    assert generate(tmp_path, tiny_model_dir, inp) == 0
    run = tmp_path / "runs" / "r"
    (good,) = read(run, "requests").to_pylist()
    assert good["id"] == "good" and good["prompt_tokens"] > 10  # the chat template's system turn was added
    errors = {e["id"]: e["error"] for e in read(run, "errors").to_pylist()}
    assert "not valid JSON" in errors["bad-json"] and "string 'role'" in errors["no-role"]
    assert "non-empty list" in errors["empty"]


def test_list_of_struct_messages_column(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hello"}],
                                          [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]]}), inp)
    assert generate(tmp_path, tiny_model_dir, inp) == 0
    assert read(tmp_path / "runs" / "r", "requests").num_rows == 2


def test_inputs_as_directory_glob_and_hive_partitions(tmp_path, tiny_model_dir):
    d = tmp_path / "ds"
    for part in ("a", "b"):
        (d / f"lang={part}").mkdir(parents=True)
        write_prompts(d / f"lang={part}" / "p.parquet", [f"{part} one", f"{part} two"], ids=[f"{part}1", f"{part}2"])
    assert generate(tmp_path, tiny_model_dir, d, run_id="dir") == 0
    assert generate(tmp_path, tiny_model_dir, str(d / "*" / "*.parquet"), run_id="glob") == 0
    for rid in ("dir", "glob"):
        ids = sorted(r["id"] for r in read(tmp_path / "runs" / rid, "requests").to_pylist())
        assert ids == ["a1", "a2", "b1", "b2"]


def test_shards_are_the_same_streamed_or_read_alone(tmp_path):
    """Workers read shards by index; the CLI streams them: both must cut the rows identically,
    across files, row groups and a column missing from one file."""
    from batchgen.data.reader import PromptDataset

    a = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(23)], "prompt": ["p"] * 23,
                             "max_tokens": pa.array(range(23), pa.int64())}), a, row_group_size=5)
    b = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(9)], "prompt": ["q"] * 9}), b, row_group_size=4)
    ds_ = PromptDataset([str(a), str(b)])
    streamed = list(ds_.shards(7))
    assert [s.index for s in streamed] == list(range(5)) == list(range(ds_.num_shards(7)))
    for s in streamed:
        alone = ds_.read_shard(s.index, 7)
        assert alone.table.equals(s.table) and alone.first_row == s.first_row == 7 * s.index
    ids = [i for s in streamed for i in s.table.column("id").to_pylist()]
    assert ids == [f"a{i}" for i in range(23)] + [f"b{i}" for i in range(9)]
    assert streamed[3].table.column("max_tokens").to_pylist() == [21, 22, None, None, None, None, None]
