"""Nothing lost, nothing wrong: resume checks what it trusts, bad rows never stop a run, signals end
it cleanly, and reports never pass a partial run off as whole. Real processes and real signals."""

import json
from pathlib import Path
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.cli import main
from batchgen.data.run_dir import RunDir

from conftest import REPO, cli_args, read_run_table, run_cli_subprocess, write_prompts

N_ROWS = 10


@pytest.fixture
def dataset(tmp_path):
    return write_prompts(tmp_path / "in.parquet", [f"prompt number {i}" for i in range(N_ROWS)],
                         ids=[f"id{i:02d}" for i in range(N_ROWS)])


def all_ids(run_dir):
    return sorted(read_run_table(run_dir, "requests").column("id").to_pylist()
                  + read_run_table(run_dir, "errors").column("id").to_pylist())


# ---- resume trusts nothing it has not checked -----------------------------------------------------

def test_input_rewritten_in_place_between_attempts_is_refused(tmp_path, dataset, tiny_model_dir, capsys):
    out = tmp_path / "runs"
    killed = run_cli_subprocess(cli_args(dataset, out, tiny_model_dir, "r"), kill_at="shard-done:1")
    assert killed.returncode == -signal.SIGKILL
    size = dataset.stat().st_size
    write_prompts(dataset, [f"prompt number {i}" for i in range(N_ROWS)], ids=[f"ix{i:02d}" for i in range(N_ROWS)])
    assert dataset.stat().st_size == size and pq.read_metadata(dataset).num_rows == N_ROWS  # same size, same rows

    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 2
    err = capsys.readouterr().err
    assert "different input (its files' content changed)" in err and len(err.strip().splitlines()) == 1
    assert not (out / "r" / "_SUCCESS").exists()


def _committed_file(run_dir, table, shard=0):
    (m,) = [m for m in RunDir(run_dir).manifests() if m["shard"] == shard]
    return run_dir / next(f["path"] for f in m["files"] if f["table"] == table)


@pytest.mark.parametrize("where", ["middle", "footer"])
def test_a_damaged_committed_shard_is_redone_and_named(tmp_path, dataset, tiny_model_dir, capsys, where):
    out, run = tmp_path / "runs", tmp_path / "runs" / "r"
    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 0
    before = {r["id"]: r["output_token_ids"] for r in read_run_table(run, "requests").to_pylist()}
    victim = _committed_file(run, "tokens", shard=1)
    data = bytearray(victim.read_bytes())
    at = len(data) // 2 if where == "middle" else len(data) - 12  # the footer: metadata length and magic
    data[at:at + 4] = bytes(b ^ 0xFF for b in data[at:at + 4])
    victim.write_bytes(bytes(data))  # same size
    (run / "_SUCCESS").unlink()
    capsys.readouterr()

    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 0
    captured = capsys.readouterr()
    assert f"shard 1 was committed but {victim} does not match the sha256 in its manifest; redoing" in captured.err
    assert "0 tokens generated" not in captured.out
    assert (run / "_SUCCESS").is_file() and not victim.exists()
    assert {r["id"]: r["output_token_ids"] for r in read_run_table(run, "requests").to_pylist()} == before
    tokens = read_run_table(run, "tokens")  # every committed file reads again
    assert tokens.num_rows == sum(len(v) for v in before.values())


def test_success_needs_the_same_id_set_not_only_the_same_count(tmp_path, dataset, tiny_model_dir):
    """A committed shard whose rows were swapped for others' ids (same count, checksums re-signed)
    must not pass the final check."""
    from batchgen.data.run_dir import RunError
    from batchgen.data.reader import PromptDataset

    out, run = tmp_path / "runs", tmp_path / "runs" / "r"
    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 0
    rd = RunDir(run)
    from batchgen.data.writer import SCHEMAS

    errors = pa.Table.from_pylist([{"id": "not-an-input-id", "error": "x", "stage": "validate"}],
                                  schema=SCHEMAS["errors"])
    requests = read_run_table(run, "requests")
    keep = requests.filter(pa.compute.not_equal(requests.column("id"), "id00"))
    tables = {t: read_run_table(run, t) for t in ("tokens", "steps")}
    tables.update(requests=keep, errors=errors)
    # bypass commit_shard's own check to plant the damage, as a buggy writer or a hand edit would
    manifest = rd.manifests()[0]
    for f in manifest["files"]:
        if f["table"] in ("requests", "errors"):
            p = run / f["path"]
            pq.write_table(tables[f["table"]], p)
            from batchgen.data.storage import sha256_file
            f.update(bytes=p.stat().st_size, sha256=sha256_file(p), rows=tables[f["table"]].num_rows)
    Path(rd.manifest_path(0)).write_text(json.dumps(manifest))
    for m in rd.manifests()[1:]:
        rd.clear_shard(m["shard"])
    with pytest.raises(RunError, match=r"1 input ids have no output \(e.g. 'id00'\).*not in the input"):
        rd.verify(PromptDataset([str(dataset)]).ids(), 1)


# ---- one bad row never stops a run -----------------------------------------------------------------

def test_out_of_range_integers_are_error_rows(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    big = 2**64 - 1
    pq.write_table(pa.table({"id": ["ok", "seed", "topk", "ok2"], "prompt": ["a b", "c d", "e f", "g h"],
                             "seed": pa.array([1, big, None, None], pa.uint64()),
                             "top_k": pa.array([None, None, big, 5], pa.uint64())}), inp)
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r", "--temperature", "0.8")) == 0
    run = tmp_path / "runs" / "r"
    errors = {e["id"]: e["error"] for e in read_run_table(run, "errors").to_pylist()}
    assert set(errors) == {"seed", "topk"}
    assert f"seed must be in [{-(2**63)}, {2**63 - 1}], got {big}" in errors["seed"]
    assert f"top_k must be in [0, {2**31 - 1}], got {big}" in errors["topk"]
    assert sorted(read_run_table(run, "requests").column("id").to_pylist()) == ["ok", "ok2"]


def test_invalid_utf8_prompt_is_an_error_row_naming_it(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    raw = pa.array([b"a fine prompt", b"bad \xff\xfe bytes", b"another fine one"], pa.binary())
    pq.write_table(pa.table({"id": ["a", "bad", "c"], "prompt": raw.view(pa.string())}), inp)
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r")) == 0
    run = tmp_path / "runs" / "r"
    (err,) = read_run_table(run, "errors").to_pylist()
    assert err["id"] == "bad" and "'prompt' is not valid UTF-8" in err["error"] and err["stage"] == "validate"
    assert sorted(read_run_table(run, "requests").column("id").to_pylist()) == ["a", "c"]


def test_a_request_that_breaks_the_engine_becomes_one_error_row(tmp_path, dataset, tiny_model_dir):
    out, run = tmp_path / "runs", tmp_path / "runs" / "r"
    proc = run_cli_subprocess(cli_args(dataset, out, tiny_model_dir, "r"), env={"BATCHGEN_FAIL_REQUESTS": "id05"})
    assert proc.returncode == 0, proc.stderr
    assert "isolating the request" in proc.stderr
    (err,) = read_run_table(run, "errors").to_pylist()
    assert err["id"] == "id05" and err["stage"] == "engine"
    assert "injected fault: request id05 breaks the engine step" in err["error"]
    assert all_ids(run) == [f"id{i:02d}" for i in range(N_ROWS)] and (run / "_SUCCESS").is_file()
    # the requests redone after the failed step give the tokens a clean run gives, and no stray token rows
    assert main(cli_args(dataset, out, tiny_model_dir, "clean")) == 0
    got = {r["id"]: r["output_token_ids"] for r in read_run_table(run, "requests").to_pylist()}
    ref = {r["id"]: r["output_token_ids"] for r in read_run_table(out / "clean", "requests").to_pylist()}
    assert got == {k: v for k, v in ref.items() if k != "id05"}
    assert read_run_table(run, "tokens").num_rows == sum(len(v) for v in got.values())


def test_an_engine_that_fails_on_everything_fails_the_shard(tmp_path, tiny_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["a b", "c d"], ids=["x", "y"])
    proc = run_cli_subprocess(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r"),
                              env={"BATCHGEN_FAIL_REQUESTS": "x,y"})
    assert proc.returncode == 2 and "the engine failed on every request of the shard" in proc.stderr
    assert not (tmp_path / "runs" / "r" / "_SUCCESS").exists()


# ---- signals end a run cleanly -----------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_release_the_lock_and_record_the_attempt(tmp_path, tiny_model_dir, sig):
    inp = write_prompts(tmp_path / "in.parquet", [f"question {i}" for i in range(12)])
    out, run = tmp_path / "runs", tmp_path / "runs" / "r"
    args = cli_args(inp, out, tiny_model_dir, "r") + ["--max-tokens", "60", "--max-num-seqs", "1", "--shard-size", "3"]
    proc = subprocess.Popen([sys.executable, "-m", "batchgen.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list((run / "_manifests").glob("*.json")) and time.time() < deadline:  # mid-run: a shard is in
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert f"interrupted by {sig.name}" in stderr
    assert not (run / ".lock").exists() and not (run / "_SUCCESS").exists()
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert attempts[-1]["status"] == "interrupted" and sig.name in attempts[-1]["detail"]
    assert main(args) == 0  # and it resumes
    assert len(all_ids(run)) == 12
    statuses = [a["status"] for a in json.loads((run / "run.json").read_text())["attempts"]]
    assert statuses == ["interrupted", "completed"]


# ---- reports never mislead about partial runs ------------------------------------------------------

def test_report_on_a_partial_run_says_so_and_reads_committed_shards_only(tmp_path, dataset, tiny_model_dir, capsys):
    out, run = tmp_path / "runs", tmp_path / "runs" / "r"
    killed = run_cli_subprocess(cli_args(dataset, out, tiny_model_dir, "r"), kill_at="commit-published:2")
    assert killed.returncode == -signal.SIGKILL
    # shard 0 is committed; shard 1's files were all written, but its manifest never was
    assert len(list((run / "requests" / "shard=00001").glob("*.parquet"))) == 1
    assert main(["report", str(run)]) == 0
    stdout = capsys.readouterr().out
    assert "run r is partial — unfinished: 1 of 3 shards, 4 of 10 rows committed" in stdout
    page = (run / "report" / "report.html").read_text()
    assert "run r is partial — unfinished: 1 of 3 shards, 4 of 10 rows committed" in page
    throughput = pq.read_table(run / "report" / "throughput.parquet").to_pylist()[0]
    assert throughput["num_requests"] + throughput["num_errors"] == 4  # shard 1's orphan files are not counted
    status = pq.read_table(run / "report" / "run_status.parquet").to_pylist()[0]
    assert status == {"run_id": "r", "shards": 3, "shards_committed": 1, "rows": 10, "rows_committed": 4,
                      "generated": throughput["num_requests"], "reused": 0, "errors": throughput["num_errors"],
                      "partial": True}


def test_report_on_a_run_with_nothing_committed_is_a_clear_error(tmp_path, dataset, tiny_model_dir, capsys):
    out, run = tmp_path / "runs", tmp_path / "runs" / "r"
    killed = run_cli_subprocess(cli_args(dataset, out, tiny_model_dir, "r"), kill_at="step:2")
    assert killed.returncode == -signal.SIGKILL
    assert main(["report", str(run)]) == 2
    assert "no shard is committed yet" in capsys.readouterr().err


def test_sigkill_then_resume_with_samples_counts_each_sample_once(tmp_path, dataset, tiny_model_dir):
    out, extra = tmp_path / "runs", ["--n", "2", "--temperature", "0.7"]
    killed = run_cli_subprocess(cli_args(dataset, out, tiny_model_dir, "r", *extra), kill_at="step:5")
    assert killed.returncode == -signal.SIGKILL
    assert main(cli_args(dataset, out, tiny_model_dir, "r", *extra)) == 0
    assert main(cli_args(dataset, out, tiny_model_dir, "clean", *extra)) == 0
    got = {(r["id"], r["sample_index"]): r["output_token_ids"] for r in read_run_table(out / "r", "requests").to_pylist()}
    ref = {(r["id"], r["sample_index"]): r["output_token_ids"] for r in read_run_table(out / "clean", "requests").to_pylist()}
    assert got == ref and len(got) == 2 * N_ROWS
    assert read_run_table(out / "r", "tokens").num_rows == sum(len(v) for v in got.values())
