"""JSONL input, the OpenAI Batch API's input format, and its output/error files."""

import json

import pytest

from conftest import cli_args, read_run_table

from batchgen.cli import main
from batchgen.data.reader import InputError, PromptDataset


def test_openai_batch_files_in_and_out(tmp_path, tiny_model_dir):
    """The OpenAI Batch input format, and output/error files line for line as the Batch API writes."""
    lines = [
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "n": 2,
                  "temperature": 0.8, "seed": 5}},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "List two colors"}], "max_tokens": 2,
                  "stop": "."}},
        {"custom_id": "req-3", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "wizard", "content": "?"}]}},
    ]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "runs"
    assert main(cli_args(inp, out, tiny_model_dir, "r", "--output-format", "openai-batch")) == 0
    got = [json.loads(l) for l in (out / "r" / "batch_output.jsonl").read_text().splitlines()]
    errs = [json.loads(l) for l in (out / "r" / "batch_errors.jsonl").read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["req-1", "req-2"] and [e["custom_id"] for e in errs] == ["req-3"]
    one = got[0]["response"]
    assert one["status_code"] == 200 and one["body"]["object"] == "chat.completion"
    assert len(one["body"]["choices"]) == 2  # n=2: two choices in one response
    assert one["body"]["choices"][0]["message"]["role"] == "assistant"
    assert one["body"]["usage"]["completion_tokens"] == sum(
        r["output_tokens"] for r in read_run_table(out / "r", "requests").to_pylist() if r["id"] == "req-1")
    assert got[0]["error"] is None and got[0]["id"].startswith("batch_req_")
    assert errs[0]["response"]["status_code"] == 400 and "role" in errs[0]["response"]["body"]["error"]["message"]
    # Parquet stays the record: the same rows are there
    assert {r["id"] for r in read_run_table(out / "r", "requests").to_pylist()} == {"req-1", "req-2"}


def test_jsonl_rows_with_the_parquet_columns(tmp_path, tiny_model_dir):
    inp = tmp_path / "rows.jsonl"
    inp.write_text('{"id": "x", "prompt": "hello", "max_tokens": 2}\n'
                   '{"id": "y", "messages": null, "prompt": "bye", "seed": 3}\nnot json\n')
    with pytest.raises(InputError, match="line 3 is not valid JSON"):
        PromptDataset([str(inp)])
    inp.write_text('{"id": "x", "prompt": "hello", "max_tokens": 2}\n{"id": "y", "prompt": "bye", "seed": 3}\n')
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "j")) == 0
    req = {r["id"]: r for r in read_run_table(tmp_path / "runs" / "j", "requests").to_pylist()}
    assert req["x"]["output_tokens"] <= 2 and req["y"]["seed"] == 3
