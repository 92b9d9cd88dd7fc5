"""Runs on object storage, against a real S3 server (moto in server mode, started by the tests)."""

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import cli_args, read_run_table, run_cli_subprocess, upload, write_prompts

from batchgen.cli import main
from batchgen.data.fs import Store, filesystem
from batchgen.data.lock import Lease, LockError
from batchgen.data.run_dir import RunDir

pytestmark = pytest.mark.heavy  # starts an S3 server


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path / "in.parquet", [f"tell me about {i}" for i in range(9)] + [""],
                         ids=[f"r{i:02d}" for i in range(10)])


def ids_of(run: str) -> tuple[list[str], list[str]]:
    req = sorted(r["id"] for r in read_run_table(run, "requests").to_pylist())
    err = sorted(r["id"] for r in read_run_table(run, "errors").to_pylist())
    return req, err


def test_a_whole_run_from_s3_input_to_s3_output(bucket, prompts, tiny_model_dir, tmp_path):
    upload(prompts, f"{bucket}/data/part-0.parquet")
    assert main(cli_args(f"{bucket}/data/", f"{bucket}/runs", tiny_model_dir, "r")) == 0
    run = f"{bucket}/runs/r"
    store = Store(run)
    assert store.exists("_SUCCESS") and store.exists("run.json")
    assert ids_of(run) == ([f"r{i:02d}" for i in range(9)], ["r09"])
    # the same run on local disk gives the same tokens: one protocol, two stores
    assert main(cli_args(prompts, tmp_path / "runs", tiny_model_dir, "local")) == 0
    s3 = {r["id"]: r["output_token_ids"] for r in read_run_table(run, "requests").to_pylist()}
    local = {r["id"]: r["output_token_ids"] for r in read_run_table(tmp_path / "runs" / "local", "requests").to_pylist()}
    assert s3 == local


def test_globs_and_jsonl_on_s3(bucket, tiny_model_dir):
    fs, _ = filesystem(bucket)
    base = bucket.removeprefix("s3://")
    fs.pipe_file(f"{base}/in/a.jsonl", b'{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    fs.pipe_file(f"{base}/in/b.jsonl", b'{"id": "c", "prompt": "three"}\n')
    fs.pipe_file(f"{base}/in/notes.txt", b"ignored")
    assert main(cli_args(f"{bucket}/in/*.jsonl", f"{bucket}/runs", tiny_model_dir, "g")) == 0
    assert ids_of(f"{bucket}/runs/g") == (["a", "b", "c"], [])


def test_kill_9_mid_run_then_resume_every_id_once(bucket, prompts, tiny_model_dir):
    upload(prompts, f"{bucket}/in.parquet")
    args = cli_args(f"{bucket}/in.parquet", f"{bucket}/runs", tiny_model_dir, "r")
    killed = run_cli_subprocess(args, kill_at="commit-staged:2")  # shard 0 committed; shard 1's files, no manifest
    assert killed.returncode == -9, killed.stderr[-2000:]
    run = RunDir(f"{bucket}/runs/r")
    # the dead attempt's files are there, but no reader sees them
    staged = run.store.list_recursive("requests/shard=00001")
    assert staged and not run.store.exists(run.manifest_name(1))
    assert [m["shard"] for m in run.manifests()] == [0]
    assert {r["id"] for r in run.read_table("requests").to_pylist()} <= {f"r{i:02d}" for i in range(4)}
    resumed = run_cli_subprocess(args, env={"BATCHGEN_LEASE_TTL_S": "60"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert ids_of(f"{bucket}/runs/r") == ([f"r{i:02d}" for i in range(9)], ["r09"])
    # the leftovers were cleaned up by the shard's commit: only manifest-named files remain
    named = {f["path"] for m in run.manifests() for f in m["files"]}
    on_store = {f for t in ("requests", "errors", "tokens", "steps") for f in run.store.list_recursive(t)}
    assert on_store == named
    attempts = json.loads(run.store.read_bytes("run.json"))["attempts"]
    assert [a["status"] for a in attempts][-1] == "completed"


def test_the_report_reads_straight_from_the_bucket(bucket, prompts, tiny_model_dir, tmp_path, capsys):
    upload(prompts, f"{bucket}/in.parquet")
    assert main(cli_args(f"{bucket}/in.parquet", f"{bucket}/runs", tiny_model_dir, "r")) == 0
    out = tmp_path / "report"
    assert main(["report", f"{bucket}/runs/r", "--out", str(out)]) == 0
    thr = pq.read_table(out / "throughput.parquet").to_pylist()[0]
    assert thr["num_requests"] == 9 and thr["num_errors"] == 1
    tokens = sum(len(r["output_token_ids"]) for r in read_run_table(f"{bucket}/runs/r", "requests").to_pylist())
    assert thr["output_tokens"] == tokens
    assert (out / "report.html").is_file()


def test_object_store_leases_are_compare_and_swap(bucket):
    """Conditional writes: of many concurrent takers exactly one wins; a live lease is refused with
    its holder named; an expired one (another host's, past its ttl) is taken over, and the old
    holder's fence then fails."""
    store = Store(f"{bucket}/run")
    for trial in range(10):
        winners, errors, held = [], [], []

        def take(i):
            try:
                held.append(Lease(store, f"t{trial}.lock", "the test lease", ttl_s=30).acquire())  # kept alive
                winners.append(i)
            except LockError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1, (winners, errors)
        assert all("already held by this process" in e or "locked by" in e for e in errors)
    # a lease of another host whose heartbeat is older than its ttl: taken over, and the fence holds
    store.write("old.lock", json.dumps({"token": "x", "pid": 1, "host": "elsewhere", "boot_id": "b",
                                        "ttl_s": 1, "since": 0, "heartbeat": 0}).encode())
    lease = Lease(store, "old.lock", "the old lease", ttl_s=30).acquire()
    holder = json.loads(store.read_bytes("old.lock"))
    assert holder["token"] == lease.token
    store.write("old.lock", json.dumps({**holder, "token": "thief"}).encode())
    with pytest.raises(LockError, match="taken over"):
        lease.check()
