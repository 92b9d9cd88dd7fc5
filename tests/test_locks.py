"""Leases that hold: one holder among many concurrent takers, no self-refusal, expiry across hosts,
release only by the holder. Real processes, real races."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from batchgen.cli import main
from batchgen.data.lock import BOOT_ID, HOST, Lease, LockError

from conftest import cli_args, write_prompts


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def plant(path, **holder):
    doc = {"token": "planted", "pid": dead_pid(), "pid_start": "1", "host": HOST, "boot_id": BOOT_ID,
           "since": time.time() - 100, "heartbeat": time.time() - 100, "ttl_s": 60, **holder}
    path.write_text(json.dumps(doc))


def _taker(path, start, done, results):
    start.wait()
    try:
        Lease(path, "test lock").acquire()
        results.put("won")
    except LockError:
        results.put("refused")
    done.wait()  # hold the lease (alive) until every taker has tried


def test_concurrent_takeover_of_a_dead_holders_lock_has_exactly_one_winner(tmp_path):
    ctx = multiprocessing.get_context("fork")
    trials, takers = 100, 3
    for trial in range(trials):
        path = tmp_path / f"trial-{trial}.lock"
        plant(path)
        start, done, results = ctx.Barrier(takers), ctx.Barrier(takers + 1), ctx.Queue()
        procs = [ctx.Process(target=_taker, args=(path, start, done, results)) for _ in range(takers)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=30) for _ in procs)
        done.wait(timeout=30)
        for p in procs:
            p.join(timeout=30)
        assert outcomes == ["refused"] * (takers - 1) + ["won"], f"trial {trial}: {outcomes}"


def test_a_lock_naming_our_own_pid_is_not_refused(tmp_path):
    """After a restart the pid in a leftover lock can be ours: it is not ours to respect."""
    path = tmp_path / "x.lock"
    plant(path, pid=os.getpid(), pid_start="0")
    lease = Lease(path, "x").acquire()
    assert json.loads(path.read_text())["token"] == lease.token
    lease.release()
    path.write_text(json.dumps({"pid": os.getpid(), "host": HOST, "since": 0}))  # the old format, no token
    Lease(path, "x").acquire().release()


def test_a_lease_held_by_this_process_is_not_taken_twice(tmp_path):
    path = tmp_path / "x.lock"
    first = Lease(path, "shard 3").acquire()
    with pytest.raises(LockError, match="already held by this process"):
        Lease(path, "shard 3").acquire()
    first.release()


def test_another_hosts_lock_expires_with_its_lease(tmp_path):
    path = tmp_path / "x.lock"
    plant(path, host="lost-node", heartbeat=time.time() - 120, ttl_s=60)  # its worker died 2 minutes ago
    Lease(path, "x").acquire().release()

    plant(path, host="live-node", heartbeat=time.time(), ttl_s=1.0)
    with pytest.raises(LockError) as refused:
        Lease(path, "run directory r").acquire()
    msg = str(refused.value)
    assert "locked by pid" in msg and "on host live-node" in msg
    assert "if that process is gone, its lease expires in" in msg and f"delete {path}" in msg
    time.sleep(1.3)  # no heartbeat came: the lease has expired
    Lease(path, "x").acquire().release()


def test_a_live_holder_keeps_its_lease_alive(tmp_path):
    path = tmp_path / "x.lock"
    lease = Lease(path, "x", ttl_s=0.4).acquire()
    first = json.loads(path.read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads(path.read_text())["heartbeat"] > first  # the keeper thread refreshed it
    doc = json.loads(path.read_text())
    doc["host"] = "elsewhere"  # judged as another host would judge it: not expired
    assert Lease(path, "x", ttl_s=0.4)._stale_reason(doc, time.time()) is None
    lease.release()
    assert not path.exists()


def test_a_process_releases_only_a_lock_it_still_holds(tmp_path):
    path = tmp_path / "x.lock"
    mine = Lease(path, "shard 0").acquire()
    plant(path, token="someone-else", host="other-node", heartbeat=time.time())  # taken over after an expiry
    with pytest.raises(LockError, match="taken over by another process"):
        mine.check()  # the fence before a commit
    assert mine.lost
    mine.release()
    assert json.loads(path.read_text())["token"] == "someone-else"  # their lock is still there


def test_the_cli_says_how_to_recover_a_lock_from_another_host(tmp_path, tiny_model_dir, capsys):
    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    plant(run / ".lock", host="rescheduled-pod-7", heartbeat=time.time(), ttl_s=60)
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r")) == 2
    err = capsys.readouterr().err
    assert "locked by pid" in err and "rescheduled-pod-7" in err and "expires in" in err
    plant(run / ".lock", host="rescheduled-pod-7", heartbeat=time.time() - 61, ttl_s=60)
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r")) == 0
    assert not (run / ".lock").exists()
