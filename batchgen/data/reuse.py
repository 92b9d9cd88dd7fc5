"""Content-keyed reuse of rows across runs: request keys, and the lookup behind `--reuse-from`.

Every generated row carries a `request_key`: a hash of everything that decides its tokens,

    the engine's numerics   engine, model fingerprint, dtype, weight format, max_model_len
    the request             the rendered prompt's token ids, the sampling parameters (max_tokens,
                            stop strings, response_format, logprobs, LoRA adapter, ...), the seed
                            (sampled rows only: greedy tokens do not depend on it) and sample index

and nothing else: not the row's id, not the batch it ran in. A key exists only where the run was
batch-invariant (batchgen.engine.model_runner: `batch_invariant` "on" in its conditions), because
only then is a row's output a function of its key; elsewhere it is null and the row is never
reused.

A new run given `--reuse-from` (run directories, a directory of runs, globs, s3:// prefixes) looks
each of its keys up among the committed rows of those runs, and copies a match instead of
generating it (with `reused_from_run`, and no timings of its own: reports count such rows apart).
Trust comes only from the commit protocol (batchgen.data.run_dir): a file is read only if a manifest
names it, and only after its bytes match the manifest's size and sha256, both when the index is
built and when a row is copied. The index is a DuckDB table in a temporary file on local disk (a
key's first 64 bits and the row's place; DuckDB spills past INDEX_MEMORY_LIMIT): the keys of any
number of earlier rows are held in bounded memory, and a shard's lookup is one join.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.config import SamplingParams
from batchgen.data.fs import filesystem, is_uri
from batchgen.data.run_dir import RunDir
from batchgen.engine.plan import EnginePlan

KEY_VERSION = 1
REUSABLE_FINISH = ("stop", "length", "repetition")  # a row that ended in an error or an abort is generated again
INDEX_MEMORY_LIMIT = "64MB"  # DuckDB spills the index to its file on disk beyond this


class ReuseError(ValueError):
    """A `--reuse-from` location that holds no run, or cannot be read."""


def numerics(model_fingerprint: str, engine_conditions: dict[str, Any], max_model_len: int) -> dict | None:
    """What of the engine decides a row's tokens, or None where they also depend on the batch (no
    key, no reuse): the engine's plan (its conditions' `plan`) must be batch-invariant. `weights` is
    the conditions' description of them (the block formats and the instruction set a kernel runs)."""
    if "plan" not in engine_conditions:  # an engine that records no plan (a test double) is not known invariant
        return None
    plan = EnginePlan.from_fields(engine_conditions["plan"])
    if not plan.batch_invariant:
        return None
    return {"engine": plan.engine, "model": model_fingerprint, "dtype": plan.dtype,
            "weights": engine_conditions.get("quantization") or "dense", "max_model_len": max_model_len}


def request_key(numerics_: dict, prompt_token_ids: list[int], sampling: SamplingParams, sample_index: int) -> str:
    """The row's key (64 hex digits): see the module's docstring for what goes in."""
    params = sampling.record()
    if sampling.greedy:
        params["seed"] = None  # greedy tokens are the same under any seed
    head = json.dumps({"v": KEY_VERSION, "numerics": numerics_, "sampling": params, "sample_index": sample_index},
                      sort_keys=True, default=list)
    h = hashlib.sha256(head.encode())
    h.update(b"\x00" + ",".join(map(str, prompt_token_ids)).encode())
    return h.hexdigest()


def find_runs(locations: list[str], exclude: str | None = None) -> list[str]:
    """The run directories under `locations`: each a run (it holds run.json), a directory of runs, or a
    glob of either; local or s3://. Sorted oldest first (by run start), without `exclude`."""
    found: dict[str, float] = {}
    skip = filesystem(exclude)[1].rstrip("/") if exclude is not None else None
    for loc in locations:
        fs, path = filesystem(loc)
        proto = str(loc).split("://", 1)[0] + "://" if is_uri(loc) else ""
        matches = fs.glob(path.rstrip("/")) if any(c in path for c in "*?[") else [path.rstrip("/")]
        hits = []
        for m in matches:
            if fs.isfile(f"{m}/run.json"):
                hits.append(m)
            else:
                hits += [r.rsplit("/", 1)[0] for r in fs.glob(f"{m}/*/run.json")]
        if not hits:
            raise ReuseError(f"--reuse-from {loc}: no run there (a run directory holds run.json)")
        for h in hits:
            if h.rstrip("/") == skip:
                continue  # the run being written
            name = proto + h if proto else str(Path(h))
            try:
                found[name] = json.loads(fs.cat_file(f"{h}/run.json")).get("run_start_wall", 0.0)
            except (OSError, ValueError) as e:
                raise ReuseError(f"--reuse-from {loc}: {name}/run.json is unreadable ({e})") from None
    return sorted(found, key=lambda n: (found[n], n))


class ReuseIndex:
    """The request keys of earlier runs' committed, checksummed rows (see the module's docstring).
    `lookup(keys)` gives each key's row (the newest run's where several have it)."""

    def __init__(self, locations: list[str], exclude: str | None = None):
        import duckdb

        self.runs = find_runs(locations, exclude)
        self.files: list[tuple[RunDir, dict]] = []  # (run, the manifest's entry of a requests file)
        self.untrusted: list[str] = []  # why a shard's rows were not taken
        self.num_keys = 0
        self._dir = tempfile.mkdtemp(prefix="batchgen-reuse-")
        self.db = duckdb.connect(str(Path(self._dir) / "index.duckdb"))
        self.db.execute(f"SET memory_limit = '{INDEX_MEMORY_LIMIT}'")
        self.db.execute("SET preserve_insertion_order = false")
        # a key's first 64 bits stand for it in the index (16 bytes a row with its place); a copied row's
        # whole key is compared before it is taken
        self.db.execute("CREATE TABLE idx (k UBIGINT, file_id INTEGER, row_id INTEGER)")
        for loc in self.runs:
            self._add_run(RunDir(loc))

    def _add_run(self, run: RunDir) -> None:
        for m in sorted(run.manifests(), key=lambda m: m["shard"]):
            for entry in (f for f in m["files"] if f["table"] == "requests"):
                table = self._read_trusted(run, entry, ["request_key", "finish_reason"])
                if table is None or "request_key" not in table.column_names:
                    continue  # untrusted (recorded), or written before request keys existed
                keys = table.column("request_key")
                ok = pc.is_in(table.column("finish_reason"), value_set=pa.array(REUSABLE_FINISH))
                rows = pa.table({"request_key": keys, "file_id": pa.array([len(self.files)] * len(table), pa.int32()),
                                 "row_id": pa.array(range(len(table)), pa.int32())}).filter(
                    pc.and_(pc.is_valid(keys), ok))
                self.files.append((run, entry))
                self.db.register("incoming", rows)
                self.db.execute("INSERT INTO idx SELECT try_cast('0x' || substr(request_key, 1, 16) AS UBIGINT), file_id, row_id "
                                "FROM incoming")
                self.db.unregister("incoming")
                self.num_keys += rows.num_rows

    def _read_trusted(self, run: RunDir, entry: dict, columns: list[str] | None = None) -> pa.Table | None:
        """The file's table (`columns` of it, those present) if its bytes are what its manifest says,
        else None (and why, recorded)."""
        where = run.store.path(entry["path"])
        try:
            data = run.store.read_bytes(entry["path"])
        except (OSError, FileNotFoundError) as e:
            self.untrusted.append(f"{where}: unreadable ({e})")
            return None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            self.untrusted.append(f"{where} does not match the size and sha256 in its manifest")
            return None
        if columns is not None:
            present = set(pq.read_schema(pa.BufferReader(data)).names)
            columns = [c for c in columns if c in present]
        return pq.read_table(pa.BufferReader(data), columns=columns)

    def lookup(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """key -> the earlier row (a dict of its requests/ columns, plus `source_run`), for the keys found."""
        if not keys or not self.num_keys:
            return {}
        self.db.register("wanted", pa.table({"request_key": pa.array(sorted(set(keys)), pa.string())}))
        hits = self.db.execute(  # the newest run's row of each key (runs are added oldest first)
            "SELECT w.request_key, max(i.file_id * 4294967296 + i.row_id) AS at FROM wanted w "
            "JOIN idx i ON i.k = try_cast('0x' || substr(w.request_key, 1, 16) AS UBIGINT) GROUP BY w.request_key").fetchall()
        self.db.unregister("wanted")
        by_file: dict[int, list[tuple[str, int]]] = {}
        for key, at in hits:
            by_file.setdefault(at >> 32, []).append((key, at & 0xFFFFFFFF))
        out = {}
        for file_id, wanted in by_file.items():
            run, entry = self.files[file_id]
            table = self._read_trusted(run, entry)  # checked again: the file may have changed since
            if table is None:
                continue
            rows = table.take(pa.array([r for _, r in wanted])).to_pylist()
            for (key, _), row in zip(wanted, rows):
                if row.get("request_key") == key:
                    out[key] = {**row, "source_run": run.name}
        return out

    def describe(self) -> dict[str, Any]:
        return {"runs": self.runs, "keys": self.num_keys, "untrusted": self.untrusted}

    def close(self) -> None:
        self.db.close()
        shutil.rmtree(self._dir, ignore_errors=True)
