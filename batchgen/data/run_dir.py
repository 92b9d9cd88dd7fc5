"""The run directory and its commit protocol: run.json, leases, per-shard manifests, resume, _SUCCESS.

    OUTPUT/<run_id>/
      run.json                                   identity (refused on resume if it changed), conditions, attempts
      requests|errors|tokens|steps/shard=00000/part-<attempt>.parquet
      _manifests/shard=00000.json                the shard's commit record, written last
      _attempts/<start>-<host>-<pid>.json        one per engine-holding process: conditions and how it ended
      _locks/shard=00000.lock, .lock             leases (batchgen.data.lock)
      _plan/rows.parquet, plan.json              a prefix-ordered run's staged input (batchgen.data.order)
      _SUCCESS                                   only after every input id is verified to be in exactly one place

The protocol (the shape of Hadoop's and Spark's output committers and of Delta Lake's log):
- a shard's data files get names unique to the attempt, so two attempts never write the same file;
- a shard is committed when, and only when, its manifest exists, naming each file with its row
  count, size and sha256; the manifest is written atomically and last, after the data is durable;
- readers (resume, the final check, reports) see only files that a manifest names; leftovers of
  dead attempts are ignored, then removed when the shard's next attempt commits;
- resume trusts a manifest only after checking every file it names against its checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.fs import Store, basename
from batchgen.data.lock import Lease, LockError
from batchgen.faults import Faults

TABLES = ("requests", "errors", "tokens", "steps")
IDENTITY_WORDS = {"input_fingerprint": "input (its files' content changed)", "model_fingerprint": "model",
                  "engine_config": "engine settings", "sampling": "sampling settings", "engine": "engine",
                  "engine_options": "engine options", "shard_size": "shard size", "too_long": "too_long policy",
                  "shard_by": "shard order (--shard-by)", "prompt_format": "prompt format (--prompt-format)"}


# what a run started before an identity field existed had: its resume compares as that
IDENTITY_DEFAULTS = {"shard_by": "order", "prompt_format": "raw"}


def _identity_change(key: str, was, now) -> str:
    """One changed part of a run's identity, named as the user sets it: "sampling settings (--max-tokens
    4, now 8)"; fingerprints by name only."""
    word = IDENTITY_WORDS.get(key, key.replace("_", " "))
    if key.endswith("fingerprint"):
        return word
    if isinstance(was, dict) and isinstance(now, dict):
        parts = [f"--{k.replace('_', '-')} {was.get(k)!r}, now {now.get(k)!r}" for k in sorted(set(was) | set(now))
                 if was.get(k) != now.get(k)]
        return f"{word} ({'; '.join(parts)})"
    return f"{word} ({was!r}, now {now!r})"


class RunError(RuntimeError):
    """The run directory cannot be used as asked (locked, changed identity, not writable)."""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


class RunDir:
    """A run's files under a local directory or an object-store prefix (s3://bucket/runs/<id>): the
    same layout and the same protocol on both; only the primitives differ (batchgen.data.fs)."""

    def __init__(self, location: str | Path, faults: Faults | None = None):
        """`faults`: the fault-injection tests' kill points in the commit protocol (none by default)."""
        self.faults = faults or Faults()
        self.store = Store(location)
        self.path = self.store.location  # a local path or a URI, as given
        self.name = basename(self.path)
        self._lock = Lease(self.store, ".lock", f"run directory {self.path}", faults=self.faults)
        self.attempt_file: str | None = None

    @staticmethod
    def shard_name(index: int) -> str:
        return f"shard={index:05d}"

    # ---- creation, identity, lease --------------------------------------------------------------

    def open(self, identity: dict[str, Any], info: dict[str, Any] | None = None) -> bool:
        """Create the run (or check that an existing one has the same identity) and take its lease.
        Returns True on resume."""
        try:
            self.store.makedirs()
            probe = f".write-test-{socket.gethostname()}-{os.getpid()}"
            self.store.write(probe, b"", atomic=False)
            self.store.delete(probe)
        except OSError as e:
            raise RunError(f"output location {self.path} cannot be written: {e.strerror or e}") from None
        self.lock()
        if self.store.exists("run.json"):
            old = {**IDENTITY_DEFAULTS, **self.read_json().get("identity", {})}
            changed = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            if changed:
                self.unlock()
                words = "; ".join(_identity_change(k, old.get(k), identity.get(k)) for k in changed)
                raise RunError(f"run {self.name} was started with a different {words}; "
                               f"use a new --run-id (or the original settings and input) to continue")
            return True
        doc = {"run_id": self.name, "run_start_wall": time.time(), "identity": identity, **(info or {})}
        self._write_json(doc)
        return False

    def read_json(self) -> dict[str, Any]:
        return json.loads(self.store.read_bytes("run.json"))

    def _write_json(self, doc: dict[str, Any]) -> None:
        self.store.write("run.json", json.dumps(doc, indent=2, sort_keys=True, default=str).encode())

    def lock(self) -> None:
        try:
            self._lock.acquire()
        except LockError as e:
            raise RunError(str(e)) from None

    def unlock(self) -> None:
        self._lock.release()

    def lease_lost(self, exc: BaseException) -> str | None:
        """After `exc` ended an attempt: the one line that says the run's lease was taken over, where
        it was (what failed then is a consequence: the new holder owns the directory); else None."""
        if self._lock.token is None or isinstance(exc, (LockError, KeyboardInterrupt)) or self._lock.still_ours():
            return None
        return self._lock._taken_over()

    def shard_lock(self, index: int) -> Lease:
        self.store.makedirs("_locks")
        return Lease(self.store, f"_locks/{self.shard_name(index)}.lock", f"shard {index} of run {self.name}",
                     faults=self.faults)

    # ---- attempts -------------------------------------------------------------------------------

    def record_attempt(self, conditions: dict[str, Any]) -> None:
        """One file per engine-holding process (workers may run in parallel); merged into run.json."""
        doc = {"started_wall": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "status": "running",
               "conditions": conditions}
        self.attempt_file = f"_attempts/{doc['started_wall']:.6f}-{doc['host']}-{doc['pid']}.json"
        self.store.write(self.attempt_file, json.dumps(doc, default=str).encode())

    def refresh_attempt(self, engine_conditions: dict[str, Any]) -> None:
        """Rewrite this process's attempt with the engine's conditions as they stand now: some are only
        known once the run has gone on (the seconds spent compiling buckets on their first use)."""
        if self.attempt_file is not None and self.store.exists(self.attempt_file):
            doc = json.loads(self.store.read_bytes(self.attempt_file))
            doc["conditions"]["engine"] = engine_conditions
            self.store.write(self.attempt_file, json.dumps(doc, default=str).encode())

    def end_attempt(self, status: str, detail: str | None = None) -> None:
        """Say how this process's attempt ended: completed | interrupted | failed; and, if we hold the
        run's lease, merge every attempt into run.json."""
        if self.attempt_file is not None and self.store.exists(self.attempt_file):
            doc = json.loads(self.store.read_bytes(self.attempt_file))
            doc.update(status=status, ended_wall=time.time(), **({"detail": detail} if detail else {}))
            self.store.write(self.attempt_file, json.dumps(doc, default=str).encode())
        if self._lock.held:
            self._merge_attempts()

    def attempts(self) -> list[dict[str, Any]]:
        docs = [json.loads(self.store.read_bytes(f)) for f in self.store.list("_attempts") if f.endswith(".json")]
        return sorted(docs, key=lambda a: a["started_wall"])

    def _merge_attempts(self) -> None:
        doc = self.read_json()
        attempts = self.attempts()
        doc["attempts"] = attempts
        if attempts:
            doc["conditions"] = {**doc.get("conditions", {}), **attempts[0]["conditions"]}
        self._write_json(doc)

    # ---- shards ---------------------------------------------------------------------------------

    def manifest_name(self, index: int) -> str:
        return f"_manifests/{self.shard_name(index)}.json"

    def manifest_path(self, index: int) -> str:
        return self.store.path(self.manifest_name(index))

    def check_shard(self, index: int) -> tuple[bool, str | None]:
        """(committed, problem): a shard counts as committed only if every file its manifest names is
        there with the recorded size and sha256. `problem` says what failed, naming the file."""
        m = self.manifest_name(index)
        try:
            files = json.loads(self.store.read_bytes(m))["files"]
        except FileNotFoundError:
            return False, None
        except (OSError, ValueError, KeyError) as e:
            return False, f"{self.store.path(m)}: unreadable manifest ({e})"
        for f in files:
            p, where = f["path"], self.store.path(f["path"])
            if not self.store.exists(p):
                return False, f"{where} is missing"
            size = self.store.size(p)
            if size != f["bytes"]:
                return False, f"{where} has {size} bytes, its manifest says {f['bytes']}"
            if self.store.sha256(p) != f["sha256"]:
                return False, f"{where} does not match the sha256 in its manifest"
        return True, None

    def clear_shard(self, index: int) -> None:
        """Remove a shard's manifest and every data file of it: what a crashed or damaged attempt left."""
        name = self.shard_name(index)
        self.store.delete(self.manifest_name(index))
        for t in TABLES:
            self.store.delete_tree(f"{t}/{name}")

    def commit_shard(self, index: int, tables: dict[str, pa.Table], input_ids: pa.Array,
                     extra: dict[str, Any] | None = None, fence: Lease | None = None) -> dict[str, Any]:
        """Check exactly-once for the shard, write its files under attempt-unique names, make them
        durable, then write the manifest that commits them. `fence` (the shard's lease) is checked
        just before the manifest, so an attempt whose lease was taken over never commits."""
        problems = exactly_once_problems(tables["requests"], tables["errors"], input_ids)
        if problems:
            raise RunError(f"shard {index}: outputs do not account for every input row exactly once: {problems}")
        name, attempt = self.shard_name(index), uuid.uuid4().hex[:12]
        files = []
        for i, t in enumerate(TABLES):
            buf = pa.BufferOutputStream()
            pq.write_table(tables[t], buf, compression="zstd")
            data = buf.getvalue().to_pybytes()
            rel = f"{t}/{name}/part-{attempt}.parquet"
            # a unique name: nobody else writes it, and no reader sees it before a manifest names it
            # (local: written in place, fsynced with its directory; object store: one PUT)
            self.store.write(rel, data, atomic=False)
            files.append({"table": t, "path": rel, "rows": tables[t].num_rows, "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
            if i == 1:
                self.faults.checkpoint("commit-staged")
        self.faults.checkpoint("commit-published")
        ids_hash = hashlib.sha256("\n".join(input_ids.to_pylist()).encode()).hexdigest()[:16]
        manifest = {"shard": index, "attempt": attempt, "rows": len(input_ids), "ok": tables["requests"].num_rows,
                    "errors": tables["errors"].num_rows, "input_ids_sha256": ids_hash, "files": files,
                    "committed_at": time.time(), **(extra or {})}
        if fence is not None:
            fence.check()
        # the commit: atomic either way (local: rename; object store: a PUT is all or nothing)
        self.store.write(self.manifest_name(index), json.dumps(manifest, indent=2).encode())
        self._remove_leftovers(index, {f["path"] for f in files})
        return manifest

    def _remove_leftovers(self, index: int, keep: set[str]) -> None:
        for t in TABLES:
            for rel in self.store.list(f"{t}/{self.shard_name(index)}"):
                if rel not in keep:
                    self.store.delete(rel)

    def manifests(self) -> list[dict[str, Any]]:
        names = [f for f in self.store.list("_manifests") if basename(f).startswith("shard=") and f.endswith(".json")]
        return [json.loads(self.store.read_bytes(f)) for f in names]

    def committed_files(self, table: str) -> list[str]:
        """The data files of `table` that manifests name: the only ones a reader may see."""
        return [self.store.path(f["path"]) for m in self.manifests() for f in m["files"] if f["table"] == table]

    def read_table(self, table: str, columns: list[str] | None = None) -> pa.Table:
        """One output table over the committed shards (leftovers of dead attempts are never read)."""
        from batchgen.data.writer import SCHEMAS

        schema = SCHEMAS[table] if columns is None else pa.schema([SCHEMAS[table].field(c) for c in columns])
        rels = [f["path"] for m in self.manifests() for f in m["files"] if f["table"] == table]
        parts = []
        for rel in rels:
            with self.store.open_input(rel) as fh:
                parts.append(pq.read_table(fh, columns=columns))
        return pa.concat_tables(parts, promote_options="default") if parts else schema.empty_table()

    # ---- the end --------------------------------------------------------------------------------

    def verify(self, input_ids: pa.Array, num_shards: int) -> dict[str, int]:
        """The set of ids across requests/ and errors/ must equal the input's, each exactly once, and
        every committed file must match its checksum. Returns the summary that _SUCCESS records."""
        manifests = self.manifests()
        if sorted(m["shard"] for m in manifests) != list(range(num_shards)):
            raise RunError(f"run {self.name}: committed shards do not match the {num_shards} expected")
        for m in manifests:
            ok, problem = self.check_shard(m["shard"])
            if not ok:
                raise RunError(f"run {self.name}: {problem}; run the same command again to redo the shard")
        cols = ["id", "sample_index", "num_samples"]
        problems = exactly_once_problems(self.read_table("requests", cols), self.read_table("errors", cols), input_ids)
        if problems:
            raise RunError(f"run {self.name}: {len(input_ids)} input rows, but {problems}; not marking success")
        return {"rows": len(input_ids), "ok": sum(m["ok"] for m in manifests),
                "errors": sum(m["errors"] for m in manifests), "shards": num_shards,
                "reused": sum(m.get("reused", 0) for m in manifests)}

    def mark_success(self, summary: dict[str, int]) -> None:
        """The run's counts (rows, generated ok, reused, errors) into run.json, then _SUCCESS."""
        if self._lock.token is not None:  # the fence: an attempt whose lease was taken over never marks it done
            self._lock.check()
        doc = self.read_json()
        doc["summary"] = summary
        self._write_json(doc)
        self.store.write("_SUCCESS", json.dumps(summary).encode())


def exactly_once_problems(requests: pa.Table, errors: pa.Table, input_ids: pa.Array) -> str | None:
    """What is wrong with the claim "every input row ends in exactly one place", or None.

    Each input id must have either one error row for the whole row (sample_index null), or, for each
    of its num_samples samples, exactly one row in requests/ or errors/ with that sample_index."""
    cols = ["id", "sample_index", "num_samples"]
    units = pa.concat_tables([requests.select(cols), errors.select(cols)])
    ids = units.column("id").combine_chunks()
    index = pc.fill_null(units.column("sample_index"), -1)
    detail = []
    missing = pc.filter(input_ids, pc.invert(pc.is_in(input_ids, value_set=ids)))
    if len(missing):
        detail.append(f"{len(missing)} input ids have no output (e.g. {missing[0].as_py()!r})")
    unexpected = pc.filter(ids, pc.invert(pc.is_in(ids, value_set=input_ids)))
    if len(unexpected):
        detail.append(f"{len(unexpected)} output ids are not in the input (e.g. {unexpected[0].as_py()!r})")
    keys = pc.binary_join_element_wise(ids, pc.cast(index, pa.string()), "\x1e")
    if len(units) and pc.count_distinct(keys).as_py() != len(units):
        detail.append(f"{len(units) - pc.count_distinct(keys).as_py()} (id, sample) pairs appear more than once")
    per_id = pa.table({"id": ids, "i": index, "n": units.column("num_samples")}).group_by("id").aggregate(
        [("i", "count"), ("i", "min"), ("i", "max"), ("n", "max")])
    whole = pc.equal(per_id.column("i_min"), -1)
    bad_whole = pc.and_(whole, pc.not_equal(per_id.column("i_count"), 1))
    n = per_id.column("n_max")
    bad_samples = pc.and_kleene(pc.invert(whole), pc.or_kleene(
        pc.or_(pc.not_equal(per_id.column("i_count"), n), pc.not_equal(per_id.column("i_min"), 0)),
        pc.not_equal(per_id.column("i_max"), pc.subtract(n, 1))))
    broken = pc.filter(per_id.column("id"), pc.or_(bad_whole, pc.fill_null(bad_samples, True)))
    if len(broken):
        detail.append(f"{len(broken)} ids do not have each of their samples exactly once (e.g. {broken[0].as_py()!r})")
    return "; ".join(detail) or None
