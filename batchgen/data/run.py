"""The run directory: run.json, a lock, atomic per-shard commits with manifests, resume, _SUCCESS.

    OUTPUT/<run_id>/
      run.json                     conditions + identity (refused on resume if it changed)
      requests|errors|tokens|steps/shard=00000/part-0.parquet
      _manifests/shard=00000.json  written last: the shard's commit record
      _SUCCESS                     only after every input row is verified to be in exactly one place
      .lock                        pid + host of the writer
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.faults import checkpoint

TABLES = ("requests", "errors", "tokens", "steps")


class RunError(RuntimeError):
    """The run directory cannot be used as asked (locked, changed identity, not writable)."""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileLock:
    """An O_EXCL lock file holding pid + host; a lock whose process is dead (same host) is taken over."""

    def __init__(self, path: Path, what: str):
        self.path = path
        self.what = what
        self.held = False

    def acquire(self) -> "FileLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(self.path.read_text() or "{}")
                except (OSError, json.JSONDecodeError):
                    holder = {}
                pid, host = holder.get("pid"), holder.get("host")
                if pid and host == me["host"] and not _pid_alive(pid):
                    self.path.unlink(missing_ok=True)  # stale: its process is dead
                    continue
                if not pid:  # half-written: its writer died between create and write
                    with contextlib.suppress(OSError):
                        if time.time() - self.path.stat().st_mtime > 5:
                            self.path.unlink(missing_ok=True)
                            continue
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
                raise RunError(f"{self.what} is locked by pid {pid} on host {host} (since {since})")
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise RunError(f"could not take the lock on {self.what}")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = FileLock(self.path / ".lock", f"run directory {self.path}")

    @staticmethod
    def shard_name(index: int) -> str:
        return f"shard={index:05d}"

    # ---- creation, identity, lock ---------------------------------------------------------------

    def open(self, identity: dict[str, Any], info: dict[str, Any] | None = None) -> bool:
        """Create the run (or check that an existing one has the same identity) and take its lock.
        Returns True on resume."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise RunError(f"output directory {self.path} cannot be written: {e.strerror}") from None
        self.lock()
        run_json = self.path / "run.json"
        if run_json.is_file():
            old = json.loads(run_json.read_text()).get("identity", {})
            changed = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            if changed:
                self.unlock()
                raise RunError(f"run {self.path.name} was started with a different {', '.join(changed)}; "
                               f"use a new --run-id (or the original settings) to continue")
            return True
        doc = {"run_id": self.path.name, "run_start_wall": time.time(), "identity": identity, **(info or {})}
        self._write_json(doc)
        return False

    def read_json(self) -> dict[str, Any]:
        return json.loads((self.path / "run.json").read_text())

    def _write_json(self, doc: dict[str, Any]) -> None:
        _fsync_write(self.path / "run.json", json.dumps(doc, indent=2, sort_keys=True, default=str).encode())

    def record_attempt(self, conditions: dict[str, Any]) -> None:
        """One file per engine-holding process (workers may run in parallel); merged into run.json at the end."""
        d = self.path / "_attempts"
        d.mkdir(exist_ok=True)
        doc = {"started_wall": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "conditions": conditions}
        _fsync_write(d / f"{doc['started_wall']:.6f}-{doc['host']}-{doc['pid']}.json",
                     json.dumps(doc, default=str).encode())

    def attempts(self) -> list[dict[str, Any]]:
        d = self.path / "_attempts"
        docs = [json.loads(p.read_text()) for p in d.glob("*.json")] if d.is_dir() else []
        return sorted(docs, key=lambda a: a["started_wall"])

    def lock(self) -> None:
        self._lock.acquire()

    def unlock(self) -> None:
        self._lock.release()

    def shard_lock(self, index: int) -> FileLock:
        (self.path / "_locks").mkdir(exist_ok=True)
        return FileLock(self.path / "_locks" / f"{self.shard_name(index)}.lock",
                        f"shard {index} of run {self.path.name}")

    # ---- shards ---------------------------------------------------------------------------------

    def manifest_path(self, index: int) -> Path:
        return self.path / "_manifests" / f"{self.shard_name(index)}.json"

    def is_committed(self, index: int) -> bool:
        m = self.manifest_path(index)
        if not m.is_file():
            return False
        doc = json.loads(m.read_text())
        return all((self.path / rel).is_file() and (self.path / rel).stat().st_size == info["bytes"]
                   for rel, info in doc["files"].items())

    def clear_partial(self, index: int) -> None:
        """Remove whatever a crashed attempt left of an uncommitted shard."""
        name = self.shard_name(index)
        self.manifest_path(index).unlink(missing_ok=True)
        for t in TABLES:
            shutil.rmtree(self.path / t / name, ignore_errors=True)
        shutil.rmtree(self.path / "_staging" / name, ignore_errors=True)

    def commit_shard(self, index: int, tables: dict[str, pa.Table], input_ids: pa.Array,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Check exactly-once for the shard, write to staging, publish by rename, then the manifest."""
        done = pa.concat_arrays([tables[t].column("id").combine_chunks().cast(pa.string())
                                 for t in ("requests", "errors")])
        if len(done) != len(input_ids) or pc.count_distinct(done).as_py() != len(done) or \
                not pc.all(pc.is_in(input_ids, value_set=done)).as_py():
            raise RunError(f"shard {index}: outputs do not account for every input row exactly once "
                           f"({len(input_ids)} in, {len(done)} out)")
        name = self.shard_name(index)
        staging = self.path / "_staging" / name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        files: dict[str, dict[str, Any]] = {}
        for t in TABLES:
            tmp = staging / f"{t}.parquet"
            pq.write_table(tables[t], tmp, compression="zstd")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            rel = f"{t}/{name}/part-0.parquet"
            files[rel] = {"rows": tables[t].num_rows, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp)}
        checkpoint("commit-staged")
        for t in TABLES:
            dest = self.path / t / name
            dest.mkdir(parents=True, exist_ok=True)
            os.replace(staging / f"{t}.parquet", dest / "part-0.parquet")
        shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            staging.parent.rmdir()  # only when no other shard is staging
        checkpoint("commit-published")
        ids_hash = hashlib.sha256("\n".join(input_ids.to_pylist()).encode()).hexdigest()[:16]
        manifest = {"shard": index, "rows": len(input_ids), "ok": tables["requests"].num_rows,
                    "errors": tables["errors"].num_rows, "input_ids_sha256": ids_hash, "files": files,
                    "committed_at": time.time(), **(extra or {})}
        self.manifest_path(index).parent.mkdir(exist_ok=True)
        _fsync_write(self.manifest_path(index), json.dumps(manifest, indent=2).encode())
        return manifest

    def manifests(self) -> list[dict[str, Any]]:
        d = self.path / "_manifests"
        return [json.loads(p.read_text()) for p in sorted(d.glob("shard=*.json"))] if d.is_dir() else []

    # ---- the end --------------------------------------------------------------------------------

    def verify_and_succeed(self, num_input_rows: int, num_shards: int) -> dict[str, int]:
        """Every input row exactly once across requests/ and errors/; then write _SUCCESS."""
        manifests = self.manifests()
        if sorted(m["shard"] for m in manifests) != list(range(num_shards)):
            raise RunError(f"run {self.path.name}: committed shards do not match the {num_shards} expected")
        ids = []
        for t in ("requests", "errors"):
            for p in sorted((self.path / t).glob("shard=*/part-0.parquet")):
                ids.append(pq.read_table(p, columns=["id"]).column("id"))
        all_ids = pa.chunked_array([c for col in ids for c in col.chunks], pa.string())
        n, distinct = len(all_ids), pc.count_distinct(all_ids).as_py() if len(all_ids) else 0
        if n != num_input_rows or distinct != n:
            raise RunError(f"run {self.path.name}: {num_input_rows} input rows but {n} output rows "
                           f"({distinct} distinct ids); not marking success")
        summary = {"rows": n, "ok": sum(m["ok"] for m in manifests), "errors": sum(m["errors"] for m in manifests),
                   "shards": num_shards}
        doc = self.read_json()
        attempts = self.attempts()
        doc["attempts"] = attempts
        if attempts:
            doc["conditions"] = {**doc.get("conditions", {}), **attempts[0]["conditions"]}
        self._write_json(doc)
        _fsync_write(self.path / "_SUCCESS", json.dumps(summary).encode())
        return summary
