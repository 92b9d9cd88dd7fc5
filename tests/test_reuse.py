"""Content-keyed reuse across runs (`--reuse-from`): a row whose request key an earlier, batch-invariant
run committed is copied, not generated; anything that changes its tokens changes its key; an earlier
run is trusted only through its manifests and checksums."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.cli import main
from batchgen.data.reuse import ReuseError, ReuseIndex, find_runs
from batchgen.model import gemv
from conftest import build_tiny_model, read_run_table, write_prompts

GEMV = gemv.load()
pytestmark = pytest.mark.needs(f"gemv kernel unavailable: {GEMV}" if isinstance(GEMV, str) else None,
                               "BATCHGEN_REQUIRE_KERNELS")  # the batch-invariant float32 kernel


def prompts(n: int, start: int = 0) -> tuple[list[str], list[str]]:
    return [f"q{i}" for i in range(start, start + n)], [f"question {i}: " + "why " * (i % 5) for i in range(start, start + n)]


def run(inp, out, model, run_id, *extra, capsys=None) -> str:
    args = ["generate", "--input", str(inp), "--output", str(out), "--run-id", run_id, "--model", str(model),
            "--max-tokens", "3", "--max-model-len", "64", "--shard-size", "300", "--max-num-seqs", "64",
            "--temperature", "0.7", "--ignore-eos", "--no-progress", *extra]
    assert main(args) == 0
    return capsys.readouterr().out if capsys else ""


def rows(out: Path, run_id: str) -> dict[str, dict]:
    return {r["id"]: r for r in read_run_table(out / run_id, "requests").to_pylist()}


@pytest.fixture
def dataset(tmp_path):
    """1,000 rows (a third of them greedy by their own temperature column), and the same 1,000 plus 100 new."""
    ids, texts = prompts(1000)
    temps = [0.0 if i % 3 == 0 else None for i in range(1000)]
    first = write_prompts(tmp_path / "first.parquet", texts, ids=ids, temperature=temps)
    new_ids, new_texts = prompts(100, start=1000)
    grown = write_prompts(tmp_path / "grown.parquet", texts + new_texts, ids=ids + new_ids,
                          temperature=temps + [None] * 100)
    return first, grown


def test_the_same_rows_plus_new_ones_generate_only_the_new_ones(tmp_path, dataset, tiny_model_dir, capsys):
    first, grown = dataset
    out = tmp_path / "runs"
    run(first, out, tiny_model_dir, "night1")
    said = run(grown, out, tiny_model_dir, "night2", "--reuse-from", str(out / "night1"), capsys=capsys)
    assert "1100 outputs (1000 reused, 100 generated)" in said
    got = rows(out, "night2")
    reused = {i for i, r in got.items() if r["reused_from_run"] == "night1"}
    assert reused == {f"q{i}" for i in range(1000)}
    assert all(got[i]["reused_from_run"] is None and got[i]["e2e_s"] is not None for i in got.keys() - reused)
    assert all(got[i]["e2e_s"] is None and got[i]["ttft_s"] is None for i in reused)  # no timings of its own
    # what invariance buys: the copied tokens are what a fresh run (other batches, other shards) makes
    run(grown, out, tiny_model_dir, "fresh", "--max-num-seqs", "7", "--shard-size", "128")
    fresh = rows(out, "fresh")
    assert {i: r["output_token_ids"] for i, r in got.items()} == {i: r["output_token_ids"] for i, r in fresh.items()}
    assert {i: r["request_key"] for i, r in got.items()} == {i: r["request_key"] for i, r in fresh.items()}
    # the counts, where a scheduler and a person look
    success = json.loads((out / "night2" / "_SUCCESS").read_text())
    assert success["reused"] == 1000 and success["ok"] == 1100
    doc = json.loads((out / "night2" / "run.json").read_text())
    assert doc["reuse_from"]["runs"] == [str(out / "night1")] and doc["summary"] == success
    # the nightly shape: the output root itself as the source (every earlier run in it), the run being written left out
    said = run(grown, out, tiny_model_dir, "night3", "--reuse-from", str(out), capsys=capsys)
    assert "1100 outputs (1100 reused, 0 generated)" in said


def test_what_changes_the_tokens_changes_the_key(tmp_path, tiny_model_dir, real_model_dir):
    ids, texts = prompts(6)
    inp = write_prompts(tmp_path / "in.parquet", texts, ids=ids)
    out = tmp_path / "runs"
    run(inp, out, tiny_model_dir, "base")
    src = ["--reuse-from", str(out / "base")]

    def reused(run_id):
        return sorted(i for i, r in rows(out, run_id).items() if r["reused_from_run"])

    run(inp, out, tiny_model_dir, "temp", "--temperature", "0.9", *src)
    assert reused("temp") == []
    edited = write_prompts(tmp_path / "edited.parquet", [texts[0] + " (edited)"] + texts[1:], ids=ids)
    run(edited, out, tiny_model_dir, "prompt", *src)
    assert reused("prompt") == ids[1:]
    run(inp, out, tiny_model_dir, "tokens", "--max-tokens", "4", *src)
    assert reused("tokens") == []
    other_model = build_tiny_model(tmp_path / "other-model", real_model_dir, seed=1)
    run(inp, out, other_model, "model", *src)
    assert reused("model") == []
    run(inp, out, tiny_model_dir, "seed", "--seed", "5", *src)  # sampled rows derive their seed from the run's
    assert reused("seed") == []
    run(inp, out, tiny_model_dir, "same", *src)
    assert reused("same") == ids


def test_a_corrupted_or_non_invariant_earlier_run_is_not_trusted(tmp_path, tiny_model_dir, capsys):
    ids, texts = prompts(8)
    inp = write_prompts(tmp_path / "in.parquet", texts, ids=ids)
    out = tmp_path / "runs"
    run(inp, out, tiny_model_dir, "base", "--shard-size", "4")
    # one shard's requests file changed after its commit: its rows are not trusted, the other shard's are
    manifest = json.loads((out / "base" / "_manifests" / "shard=00001.json").read_text())
    path = out / "base" / next(f["path"] for f in manifest["files"] if f["table"] == "requests")
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", pa.array(["forged"] * len(table))),
                   path)
    capsys.readouterr()
    run(inp, out, tiny_model_dir, "after", "--reuse-from", str(out / "base"))
    err = capsys.readouterr().err
    assert "not trusted" in err and "does not match the size and sha256" in err
    got = rows(out, "after")
    assert sorted(i for i, r in got.items() if r["reused_from_run"]) == ids[:4]
    assert "forged" not in {r["text"] for r in got.values()}
    # a run that was not batch-invariant has no keys: nothing of it is reused
    run(inp, out, tiny_model_dir, "loose", "--batch-invariant", "off")
    assert all(r["request_key"] is None for r in rows(out, "loose").values())
    run(inp, out, tiny_model_dir, "after2", "--reuse-from", str(out / "loose"))
    assert not any(r["reused_from_run"] for r in rows(out, "after2").values())


def test_reuse_locations_are_found_or_refused(tmp_path, tiny_model_dir):
    ids, texts = prompts(3)
    inp = write_prompts(tmp_path / "in.parquet", texts, ids=ids)
    out = tmp_path / "runs"
    for r in ("2026-12-01", "2026-12-02"):
        run(inp, out, tiny_model_dir, r)
    assert find_runs([str(out / "2026-12-*")]) == [str(out / "2026-12-01"), str(out / "2026-12-02")]
    assert find_runs([str(out)], exclude=str(out / "2026-12-02")) == [str(out / "2026-12-01")]
    with pytest.raises(ReuseError, match="no run there"):
        find_runs([str(tmp_path / "nothing")])
    assert main(["generate", "--input", str(inp), "--output", str(out), "--model", str(tiny_model_dir),
                 "--reuse-from", str(tmp_path / "nothing"), "--no-progress"]) == 2
    index = ReuseIndex([str(out)])
    try:
        assert index.num_keys == 6 and not index.untrusted
        key = rows(out, "2026-12-02")["q0"]["request_key"]
        hit = index.lookup([key, "0" * 64])
        assert list(hit) == [key] and hit[key]["source_run"] == "2026-12-02"  # the newest run's row
    finally:
        index.close()


def test_reports_count_reused_rows_apart_and_time_only_generated_ones(tmp_path, tiny_model_dir):
    """run_status counts generated / reused / errors per run; latency and throughput are made of the
    generated rows only (checked against the tables read in Python)."""
    from batchgen.report.queries import connect, run_query

    ids, texts = prompts(12)
    out = tmp_path / "runs"
    run(write_prompts(tmp_path / "a.parquet", texts[:8], ids=ids[:8]), out, tiny_model_dir, "a")
    run(write_prompts(tmp_path / "b.parquet", texts + [""], ids=ids + ["empty"]), out, tiny_model_dir, "b",
        "--reuse-from", str(out / "a"))
    con = connect([str(out / "a"), str(out / "b")])
    status = {r["run_id"]: r for r in run_query(con, "run_status").to_pylist()}
    assert (status["a"]["generated"], status["a"]["reused"], status["a"]["errors"]) == (8, 0, 0)
    assert (status["b"]["generated"], status["b"]["reused"], status["b"]["errors"]) == (4, 8, 1)
    from batchgen.cli import main as cli_main

    assert cli_main(["report", str(out / "b"), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "Rows: generated, reused from earlier runs, errors" in page
    b = rows(out, "b")
    generated = [r for r in b.values() if r["reused_from_run"] is None]
    tp = {r["run_id"]: r for r in run_query(con, "throughput").to_pylist()}
    assert tp["b"]["num_requests"] == len(generated) == 4
    assert tp["b"]["output_tokens"] == sum(r["output_tokens"] for r in generated)
    lat = {(r["run_id"], r["metric"]): r for r in run_query(con, "request_latency").to_pylist()}
    assert lat[("b", "e2e_s")]["n"] == 4


def test_the_reuse_benchmark_runs_at_a_small_size(capsys):
    """`python -m batchgen.benchmarks.reuse` (a million rows by default) at 3,000 rows: its figures and
    conditions are printed; the figures themselves are never asserted."""
    from batchgen.benchmarks import reuse

    reuse.main(["--rows", "3000", "--shards", "2", "--keys-per-shard", "100"])
    out = capsys.readouterr().out
    assert "conditions: 3,000 earlier rows in 1 committed shards" in out
    assert "index build:" in out and "for 3,000 keys" in out
    assert "2 shards" in out and "180 rows found and copied" in out  # 90 of each shard's 100 keys exist
    assert "naive peer" in out and "ratios:" in out
