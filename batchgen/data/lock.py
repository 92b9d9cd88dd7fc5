"""Leases: the run's lock and the per-shard locks, correct with many takers and across hosts.

A lease is a small JSON file naming its holder (a random token, pid, the pid's start time, host,
boot id) and a heartbeat. The holder refreshes the heartbeat every `ttl_s / 4` from one daemon thread.

Who may take a lease that exists:
- same host and boot: only when the holder's process is gone (its pid is dead, or now belongs to a
  process that started at another time: pid reuse after a restart, including our own pid);
- another host (a Ray worker on a lost node, a rescheduled pod on shared storage): only when the
  heartbeat is older than the ttl the holder stated. Hosts' clocks are assumed to agree to well
  within the ttl (NTP), as in every lease protocol.

Every read-judge-write of a lease file happens under `flock` on a guard file beside it, so a
takeover is a compare-and-swap: of any number of concurrent takers exactly one wins. The guard is
never deleted (deleting a flocked file would break the exclusion). The guard is held for one read
and one write, so a taker waits for it at most GUARD_DEADLINE_S: a holder frozen inside it (stopped
by SIGSTOP, or stuck in I/O on a network filesystem) cannot block a taker without bound; the taker
then refuses in one line naming who holds the guard (each holder writes its pid and host into the
guard file), since when, and what to do.

On an object store the same read-judge-write is a conditional write (If-None-Match: * to create,
If-Match: <ETag> to replace): a writer that lost the race gets 412, reads the new holder and judges
again. A write whose outcome is unknown (its response lost to a timeout or a reset, then retried into
a 412, or failed) is resolved the same way, by reading back: when the store holds exactly what we
wrote (or, for a release, nothing), the write was ours. The judging rules are the same code on both.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterator

from batchgen.faults import Faults

DEFAULT_TTL_S = float(os.environ.get("BATCHGEN_LEASE_TTL_S", "60"))
# the longest a taker waits for a lease's guard (held by a healthy holder for one read and one write)
GUARD_DEADLINE_S = float(os.environ.get("BATCHGEN_LEASE_GUARD_S", "30"))


class LockError(RuntimeError):
    """A lease is held by someone else (the message names the holder and how to recover)."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ""  # exists, unreadable: treat as alive with an unknown start
    return stat.rsplit(")", 1)[1].split()[19]


def _pid_alive(pid: int, start: str | None) -> bool:
    """Is the process that wrote the lease still running? A reused pid is not it."""
    if not Path("/proc").is_dir():  # no procfs (macOS): fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    now = _pid_start(pid)
    if now is None:
        return False
    return not start or not now or now == start


HOST, BOOT_ID = socket.gethostname(), _boot_id()


def _process_state(pid: int) -> str | None:
    """The state letter of a local process (T: stopped, D: waiting on I/O, ...), or None if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _guard_refusal(guard: Path, what: str, waited_s: float) -> str:
    """One line for a taker that waited past the deadline: who holds the guard, since when, what to do."""
    try:
        holder = json.loads(guard.read_text() or "{}")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        holder = {}
    msg = f"{what}: gave up after {waited_s:.0f} s waiting for {guard}, which another process holds"
    if not holder.get("pid"):
        return msg + "; that process may be stopped or stuck in I/O: find it (fuser or lsof on that file), then " \
                     "continue or end it and re-run"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    msg = f"{msg}: pid {holder['pid']} on host {holder.get('host', '?')}, since {since}"
    if holder.get("host") == HOST:
        state = _process_state(int(holder["pid"]))
        how = {"T": "is stopped (SIGSTOP): `kill -CONT {pid}` lets it finish, or end it",
               "t": "is stopped by a debugger: detach it, or end it",
               "D": "is stuck in I/O (a filesystem that does not answer): fix the mount, or end it"}.get(state or "")
        if how:
            return f"{msg}; that process {how.format(pid=holder['pid'])}, then re-run"
    return (f"{msg}; that process is frozen or stuck inside the lease's guard (stopped, or in I/O on a network "
            f"filesystem): continue or end it on its host, then re-run")


@contextlib.contextmanager
def _guard(path: Path, what: str, faults: Faults, deadline_s: float | None = None) -> Iterator[None]:
    """flock on the guard beside `path`, waited for at most `deadline_s` (GUARD_DEADLINE_S); LockError
    past it. The holder writes its pid, host and time into the guard file, for that error's line."""
    guard = path.with_name(path.name + ".guard")
    fd = os.open(guard, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        limit = GUARD_DEADLINE_S if deadline_s is None else deadline_s
        t0, pause = time.monotonic(), 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if waited >= limit:
                    raise LockError(_guard_refusal(guard, what, waited)) from None
                time.sleep(min(pause, limit - waited))
                pause = min(pause * 2, 0.05)
        me = json.dumps({"pid": os.getpid(), "host": HOST, "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)
        faults.checkpoint("guard")
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{doc['token']}")
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_DELETE = object()  # a transaction's verdict: remove the lease file


class Lease:
    """A lock file that expires unless its holder keeps it alive. Use as a context manager.

    `Lease(path, what)` for a local file, or `Lease(store, name, what)` for a name inside a
    batchgen.data.fs.Store (a local directory or an object-store prefix)."""

    def __init__(self, where, name_or_what: str, what: str | None = None, ttl_s: float = DEFAULT_TTL_S,
                 faults: Faults | None = None):
        if what is None:  # Lease(path, what)
            self.store, self.name, what = None, None, name_or_what
            self.path = Path(where)
        else:
            self.store, self.name = where, name_or_what
            self.path = Path(where.path(name_or_what)) if where.local else None
        self.location = str(self.path) if self.path is not None else self.store.path(self.name)
        self.what = what
        self.ttl_s = ttl_s
        self.token: str | None = None
        self.lost = False  # set when a heartbeat finds that someone else holds the lease now
        self.faults = faults or Faults()  # the fault tests' stop and kill points (none by default)

    @property
    def held(self) -> bool:
        return self.token is not None and not self.lost

    def _transact(self, judge):
        """judge(holder or None) -> (verdict, result), atomically against the lease file: verdict is
        a new document to write, _DELETE, or None (leave it). Returns result."""
        if self.path is not None:
            with _guard(self.path, self.what, self.faults):
                verdict, result = judge(_read(self.path))
                if verdict is _DELETE:
                    self.path.unlink(missing_ok=True)
                elif verdict is not None:
                    _write(self.path, verdict)
            return result
        from batchgen.data.fs import OutcomeUnknown, PreconditionFailed

        unknown: OutcomeUnknown | None = None
        pending = None  # (what our last write put there, or _DELETE; its result) while its outcome is in doubt
        for attempt in range(20):
            got = self.store.read_versioned(self.name)
            if pending is not None:  # a 412 or no answer: if the store now holds exactly our write, it landed
                wrote, result = pending
                if (got is None) if wrote is _DELETE else (got is not None and got[0] == wrote):
                    return result
                pending = None
            holder = None
            if got is not None:
                try:
                    holder = json.loads(got[0] or b"{}")
                except (json.JSONDecodeError, UnicodeDecodeError):
                    holder = {}
            verdict, result = judge(holder)
            data = verdict if verdict is None or verdict is _DELETE else json.dumps(verdict).encode()
            try:
                if verdict is _DELETE:
                    self.store.delete(self.name)
                elif verdict is not None:
                    if got is None:
                        self.store.create_exclusive(self.name, data)
                    else:
                        self.store.replace_if(self.name, data, got[1])
                return result
            except PreconditionFailed:  # someone wrote between our read and our write, or we did (a retry of
                pending = (data, result)  # a write whose response was lost): the next read tells which
            except OutcomeUnknown as e:  # applied or not: the next read says
                pending, unknown = (data, result), e
                time.sleep(min(0.05 * 2 ** attempt, 2.0))
        if unknown is not None:
            raise LockError(f"{self.what}: {self.location} did not answer a conditional write 20 times ({unknown}); "
                            f"try again") from unknown
        raise LockError(f"{self.what}: too many concurrent writers of {self.location}; try again")

    def _stale_reason(self, holder: dict[str, Any], now: float) -> str | None:
        """Why the lease in the file can be taken over, or None if its holder may still be alive."""
        if not holder.get("pid"):
            age = _age(self.path) if self.path is not None else 10.0
            return "it is unreadable" if age > 5 else None  # not ours to judge for a moment
        if holder.get("token") in _HELD:
            return None  # held by this very process (another part of it): never a second holder
        if holder.get("host") == HOST and holder.get("boot_id", BOOT_ID) == BOOT_ID:
            if int(holder["pid"]) == os.getpid():
                return "it names this process, which does not hold it (pid reuse)"
            return None if _pid_alive(int(holder["pid"]), holder.get("pid_start")) else "its process is gone"
        if holder.get("host") == HOST:
            return "its host has rebooted since"
        if now - float(holder.get("heartbeat", 0)) > float(holder.get("ttl_s", self.ttl_s)):
            return "its lease expired"
        return None

    def acquire(self) -> "Lease":
        me = {"token": uuid.uuid4().hex, "pid": os.getpid(), "pid_start": _pid_start(os.getpid()), "host": HOST,
              "boot_id": BOOT_ID, "ttl_s": self.ttl_s}
        def judge(holder):
            now = time.time()
            if holder is not None and holder.get("token") == me["token"]:
                return None, None  # our own write, whose response was lost: it is ours
            if holder is not None and self._stale_reason(holder, now) is None:
                return None, self._refusal(holder, now)
            return {**me, "since": now, "heartbeat": now}, None

        # known as ours before it is written: another thread of this process that reads it next must
        # see a live holder, not "this pid, but not held" (which would read as pid reuse)
        _HELD[me["token"]] = self
        try:
            refusal = self._transact(judge)
        except BaseException:
            _HELD.pop(me["token"], None)
            raise
        if refusal:
            _HELD.pop(me["token"], None)
            raise LockError(refusal)
        self.token, self.lost = me["token"], False
        _Keeper.ensure_running()
        return self

    def _refusal(self, holder: dict[str, Any], now: float) -> str:
        if not holder.get("pid"):
            return f"{self.what} is being locked by another process right now; try again"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
        if holder.get("token") in _HELD:
            return f"{self.what} is already held by this process (pid {holder['pid']})"
        msg = f"{self.what} is locked by pid {holder['pid']} on host {holder['host']} (since {since})"
        if holder.get("host") == HOST:
            return msg + "; that process is still running: stop it, or wait for it to finish"
        expires = float(holder.get("heartbeat", 0)) + float(holder.get("ttl_s", self.ttl_s))
        return (msg + f"; if that process is gone, its lease expires in {max(expires - now, 0):.0f} s "
                f"(at {time.strftime('%H:%M:%S', time.localtime(expires))}) and a re-run then takes it over; "
                f"to take it now, delete {self.location}")

    def heartbeat(self) -> bool:
        """Refresh our heartbeat if the lease is still ours; False (and `lost`) if it is not."""
        if self.token is None:
            return False

        def judge(holder):
            if not holder or holder.get("token") != self.token:
                return None, False
            return {**holder, "heartbeat": time.time()}, True

        if not self._transact(judge):
            self.lost = True
            return False
        return True

    def check(self) -> None:
        """Raise unless we still hold the lease: the fence before a commit."""
        if not self.heartbeat():
            raise LockError(self._taken_over())

    def _taken_over(self) -> str:
        return f"{self.what}: our lock was taken over by another process; this attempt stops without committing"

    def still_ours(self) -> bool:
        """Whether the lease is still ours, asked after something failed: False once it was taken over
        (a store that does not answer says nothing either way: True)."""
        if self.lost:
            return False
        try:
            return self.heartbeat()
        except Exception:  # noqa: BLE001 - unknown is not lost
            return True

    def release(self) -> None:
        """Remove the lease only if it is still ours: never someone else's."""
        token, self.token = self.token, None
        if token is None:
            return
        _HELD.pop(token, None)
        self._transact(lambda holder: (_DELETE if holder and holder.get("token") == token else None, None))

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> None:
        """Release; and where the block failed after our lease was taken over (the new holder may have
        cleared the files this attempt was writing), end with the one line that says so, the failure
        chained beneath it."""
        lost = exc is not None and not isinstance(exc, (LockError, KeyboardInterrupt)) and not self.still_ours()
        self.release()
        if lost:
            raise LockError(self._taken_over()) from exc


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


_HELD: "weakref.WeakValueDictionary[str, Lease]" = weakref.WeakValueDictionary()


class _Keeper:
    """One daemon thread per process that keeps every held lease alive."""

    _thread: threading.Thread | None = None
    _pid: int | None = None
    _wake = threading.Event()  # a new lease may have a shorter ttl than the keeper's current pace

    @classmethod
    def ensure_running(cls) -> None:
        cls._wake.set()
        if cls._thread is not None and cls._thread.is_alive() and cls._pid == os.getpid():
            return
        cls._pid = os.getpid()
        cls._thread = threading.Thread(target=cls._loop, name="batchgen-lease-keeper", daemon=True)
        cls._thread.start()

    @classmethod
    def _loop(cls) -> None:
        while True:
            cls._wake.clear()
            leases = list(_HELD.values())
            interval = min((lease.ttl_s for lease in leases), default=DEFAULT_TTL_S) / 4
            cls._wake.wait(max(interval, 0.05))
            for lease in list(_HELD.values()):
                with contextlib.suppress(Exception):  # a network blip must not end the keeper: retry next beat
                    lease.heartbeat()
