"""Faults a cluster sees, injected for real: an object store that answers 503, resets connections and
loses the response of a conditional write it applied (a proxy in front of moto: fault_proxy); a lease
holder frozen (SIGSTOP) at any point, inside a lease's guard included, while a taker on another host
(its own UTS namespace: `unshare -u`) resumes the run. Every id ends in exactly one place, a taker never
waits without bound, and a holder that lost its lease says so in one line."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, cli_args, read_run_table, run_cli_subprocess, upload, write_prompts
from fault_proxy import FaultProxy

from batchgen.data.fs import OutcomeUnknown, Store
from batchgen.data.lock import Lease, LockError

pytestmark = pytest.mark.heavy  # starts an S3 server and many CLI processes

IDS = [f"r{i:02d}" for i in range(12)]


def ids_once(run) -> list[str]:
    """Every id of the run's outputs, requests and errors together, sorted (a repeat shows twice)."""
    return sorted([r["id"] for r in read_run_table(run, "requests").to_pylist()]
                  + [r["id"] for r in read_run_table(run, "errors").to_pylist()])


def test_a_job_through_lost_responses_completes_with_every_id_once(bucket, tiny_model_dir, tmp_path):
    """35% of the conditional writes (lease creations, renewals, takeovers) are applied by the store
    and their response is lost; 3% of all requests get 503 SlowDown and 3% a reset. The job completes
    within three attempts, every id exactly once."""
    inp = write_prompts(tmp_path / "in.parquet", [f"tell me about {i}" for i in range(12)], ids=IDS)
    upload(inp, f"{bucket}/in.parquet")
    args = cli_args(f"{bucket}/in.parquet", f"{bucket}/runs", tiny_model_dir, "r")
    attempts = []
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], seed=7, slow_down=0.03, reset=0.03,
                    lost_conditional=0.35) as proxy:
        for _ in range(3):
            done = run_cli_subprocess(args, env={"AWS_ENDPOINT_URL": proxy.endpoint, "BATCHGEN_LEASE_TTL_S": "20"})
            attempts.append(done)
            if done.returncode == 0:
                break
    assert attempts[-1].returncode == 0, [a.stderr[-800:] for a in attempts]
    assert proxy.injected["lost_conditional"] >= 3, proxy.injected  # the faults were there
    assert ids_once(f"{bucket}/runs/r") == IDS
    assert Store(f"{bucket}/runs/r").exists("_SUCCESS")


def test_a_conditional_write_whose_response_was_lost_is_ours_on_reading_back(bucket):
    """The lease protocol alone, every response of a conditional write lost: a create (the retry gets
    412), a renewal and a release each resolve by reading back, and a second taker is still refused."""
    import s3fs

    with FaultProxy(os.environ["AWS_ENDPOINT_URL"], seed=1, lost_conditional=1.0) as proxy:
        old = os.environ["AWS_ENDPOINT_URL"]
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        s3fs.S3FileSystem.clear_instance_cache()  # a client made now reads the proxy's endpoint
        try:
            store = Store(f"{bucket}/run")
            lease = Lease(store, "x.lock", "shard 3 of run r", ttl_s=30).acquire()
            assert json.loads(store.read_bytes("x.lock"))["token"] == lease.token
            assert lease.heartbeat()
            with pytest.raises(LockError, match="already held by this process"):
                Lease(store, "x.lock", "shard 3 of run r", ttl_s=30).acquire()
            lease.release()
            assert not store.exists("x.lock")
        finally:
            os.environ["AWS_ENDPOINT_URL"] = old
            s3fs.S3FileSystem.clear_instance_cache()
    assert proxy.injected["lost_conditional"] >= 2


def test_an_unanswered_conditional_write_is_resolved_by_reading_back(tmp_path, monkeypatch):
    """Where the client gives up on a write whose outcome is unknown (OutcomeUnknown), the lease reads
    the object back: applied, it is ours; not applied, the write is tried again."""

    class LossyStore:  # a test double for an object store's conditional writes, in memory
        local = False

        def __init__(self):
            self.doc, self.tag, self.calls = None, 0, []

        def path(self, rel):
            return f"mem://{rel}"

        def read_versioned(self, rel):
            return None if self.doc is None else (self.doc, str(self.tag))

        def create_exclusive(self, rel, data):
            self.calls.append("create")
            if len(self.calls) == 1:  # applied, then the connection dropped
                self.doc, self.tag = data, self.tag + 1
                raise OutcomeUnknown("ReadTimeoutError: read timed out")
            raise AssertionError("a second create after reading back our own lease")

        def replace_if(self, rel, data, version):
            self.calls.append("replace")
            if self.calls.count("replace") == 1:  # not applied: the request never reached the store
                raise OutcomeUnknown("ConnectionClosedError: connection reset")
            self.doc, self.tag = data, self.tag + 1

        def delete(self, rel):
            self.doc = None

    store = LossyStore()
    lease = Lease(store, "x.lock", "the test lease", ttl_s=30).acquire()
    assert json.loads(store.doc)["token"] == lease.token and store.calls == ["create"]
    assert lease.heartbeat()  # the first renewal never reached the store: tried again (the keeper may renew too)
    assert store.calls.count("create") == 1 and store.calls.count("replace") >= 2
    assert json.loads(store.doc)["token"] == lease.token
    lease.release()
    assert store.doc is None


# ---- a holder frozen in place, a taker on another host ----------------------------------------------

def _unshare_works() -> str | None:
    if not shutil.which("unshare"):
        return "no unshare(1) here"
    probe = subprocess.run(["unshare", "-u", "sh", "-c", "hostname taker-host && hostname"], capture_output=True,
                           text=True)
    return None if probe.returncode == 0 and probe.stdout.strip() == "taker-host" else \
        f"unshare -u cannot set a host name here ({probe.stderr.strip()[:200]})"


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _cli(args, env=None, host=None, **kw):
    """The CLI in a process of its own, on host `host` (a UTS namespace of its own) where given."""
    argv = [sys.executable, "-m", "batchgen.cli", *args]
    if host:
        argv = ["unshare", "-u", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *argv]
    return subprocess.Popen(argv, env={**os.environ, **(env or {})}, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.skipif(_unshare_works() is not None, reason=str(_unshare_works()))
def test_a_frozen_holder_never_blocks_a_taker_past_its_deadline(tmp_path, tiny_model_dir):
    """Host A runs a job and is stopped (SIGSTOP) at a point drawn at random, one of them inside a
    lease's guard; host B resumes the same run directory. B finishes, or refuses in one line naming
    the holder and what to do, within a bound; A, continued, ends with the lost-lease line (or
    finishes, where B refused); where neither finished, a last resume does; every id exactly once."""
    inp = write_prompts(tmp_path / "in.parquet", [f"tell me about {i}" for i in range(12)], ids=IDS)
    rng = random.Random(int(os.environ.get("BATCHGEN_FAULT_SEED", "3")))
    # inside the run lease's guard; inside a guard drawn among the next passes (renewals, shard leases);
    # outside any guard, at a point of the run drawn at random
    points = ["guard:1", f"guard:{rng.randint(2, 12)}",
              rng.choice([f"step:{rng.randint(1, 8)}", "commit-staged:2", "shard-done:1"])]
    outcomes = {}
    for trial, point in enumerate(points):
        out, run_id = tmp_path / f"runs{trial}", "r"
        args = cli_args(inp, out, tiny_model_dir, run_id)
        # A's leases say a 2 s ttl: once it stops beating, another host may take them after that
        a = _cli(args, env={"BATCHGEN_STOP_AT": point, "BATCHGEN_LEASE_TTL_S": "2"})
        deadline = time.monotonic() + 120
        while _state(a.pid) not in ("T", "gone") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(a.pid) == "T", f"{point}: A never stopped ({a.communicate()[1][-800:]})"
        time.sleep(2.5)  # past A's ttl: its heartbeats have stopped
        t0 = time.monotonic()
        b = _cli(args, env={"BATCHGEN_LEASE_GUARD_S": "3"}, host="taker-host")
        b_out, b_err = b.communicate(timeout=180)
        took = time.monotonic() - t0
        b_lines = [line for line in b_err.splitlines() if line.startswith("batchgen: error:")]
        assert b.returncode in (0, 2), f"{point}: B exited {b.returncode}: {b_err[-1500:]}"
        assert took < 120, f"{point}: B took {took:.0f} s"
        if b.returncode == 2:  # refused in one line: who, since when, and what to do
            assert len(b_lines) == 1, b_err[-1500:]
            assert "gave up after" in b_lines[0] and "pid" in b_lines[0] and "then re-run" in b_lines[0], b_lines
        os.kill(a.pid, signal.SIGCONT)
        _, a_err = a.communicate(timeout=180)
        if b.returncode == 0:  # B took over and finished: A, continued, says it lost its lease
            assert a.returncode == 2, f"{point}: A exited {a.returncode}: {a_err[-1500:]}"
            a_lines = [line for line in a_err.splitlines() if line.startswith("batchgen: error:")]
            assert len(a_lines) == 1 and "taken over by another process" in a_lines[0], (point, a_err[-1500:])
        if b.returncode != 0 and a.returncode != 0:  # nobody finished: the resume a person runs next
            last = run_cli_subprocess(args)
            assert last.returncode == 0, f"{point}: {last.stderr[-1500:]}"
        assert ids_once(out / run_id) == IDS, point
        outcomes[point] = "finished" if b.returncode == 0 else "refused"
    # a holder frozen in the run lease's guard is refused after the deadline; frozen outside a guard, taken over
    assert outcomes["guard:1"] == "refused" and outcomes[points[2]] == "finished", outcomes
