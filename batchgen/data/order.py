"""The order rows are sharded in: as given, or grouped by the prefix they share (`--shard-by`).

The prefix cache saves prefill only when rows that share a prefix (a system prompt, a few-shot
template) run while it is cached: in one shard, on one worker. In input order every shard meets every
prefix. `--shard-by prefix` stages the input once, sorted by each row's leading text (its system
prompt, then the prompt or the messages' contents, as bytes), and cuts shards from that order:
- each shard holds rows of one or a few prefixes, and adjacent shards share them (a Ray lane takes a
  contiguous run of shards: flows/generate.py);
- every shard but the last has exactly shard_size rows (balanced);
- ties keep input order, so staging the same input again gives the same file, byte for byte.

Without holding the input in memory:
1. one pass computes each row's key (its first KEY_BYTES bytes of leading text); DuckDB sorts the
   (key, row) pairs, spilling to disk past its memory limit; the permutation comes back (8 bytes a row);
2. a second pass appends each row to the partition file of its destination (a partition is a run of
   consecutive shards of about PARTITION_ROWS rows);
3. each partition is sorted by position and appended to the staged file, one row group per shard.

The staged file lives in the run directory, `_plan/rows.parquet`, and `_plan/plan.json` names its size
and sha256: a resume checks it and reads the same shards; a worker reads its shard's row group. Each row
carries its input row number (ROW), which is its id where the input has no id column.

`auto` stages when at least PROBE_SHARE of the first PROBE_ROWS rows share their first PROBE_BYTES
bytes (about 64 tokens, four KV blocks) with another of them; else rows are sharded as given.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.fs import Store
from batchgen.data.reader import MESSAGES, ROW, PromptDataset
from batchgen.data.storage import sha256_file

SHARD_BY = ("auto", "prefix", "order")
KEY_BYTES = 16384  # ~4,000 tokens of leading text decide the order; longer shared prefixes tie, in input order
PROBE_ROWS, PROBE_BYTES, PROBE_SHARE = 10_000, 256, 0.25
PARTITION_ROWS = 65_536
ROWS_FILE, PLAN_FILE = "_plan/rows.parquet", "_plan/plan.json"
SORT_MEMORY = "512MB"  # DuckDB's limit while sorting the keys; it spills past it


class PlanError(RuntimeError):
    """The staged order in a run directory does not match what the run needs."""


def leading_text(table: pa.Table, prompt_column: str, limit: int = KEY_BYTES) -> pa.Array:
    """Each row's first `limit` bytes of leading text, as binary: the system column, a NUL, then the
    prompt (or the messages' contents joined by NUL). Bytes, so text that is not valid UTF-8 sorts too."""
    col = table.column(prompt_column).combine_chunks()
    if pa.types.is_string(col.type):
        text = col.cast(pa.binary())
    elif prompt_column == MESSAGES and pa.types.is_struct(col.type.value_type) \
            and col.type.value_type.get_field_index("content") >= 0:
        content = col.values.field("content").cast(pa.binary())
        text = pc.binary_join(pa.ListArray.from_arrays(col.offsets, content), b"\x00")
    else:
        text = pa.array([json.dumps(v).encode() for v in col.to_pylist()], pa.binary())
    system = (table.column("system").combine_chunks().cast(pa.binary()) if "system" in table.column_names
              else pa.nulls(table.num_rows, pa.binary()))
    key = pc.binary_join_element_wise(system.fill_null(b""), text.fill_null(b""), b"\x00")
    return pc.binary_slice(key, 0, limit)


def shared_prefix_share(dataset: PromptDataset) -> float:
    """The share of the first PROBE_ROWS rows whose first PROBE_BYTES bytes of leading text another of
    them has too (rows shorter than that do not count: too little to cache)."""
    n = min(dataset.num_rows, PROBE_ROWS)
    keys = pa.chunked_array([leading_text(p, dataset.prompt_column, PROBE_BYTES) for p in dataset.pieces(0, n)],
                            pa.binary())
    full = keys.filter(pc.equal(pc.binary_length(keys), PROBE_BYTES))
    if len(full) == 0:
        return 0.0
    counts = pc.value_counts(full)
    shared = sum(c for c in counts.field("counts").to_pylist() if c > 1)
    return shared / n


def resolve(dataset: PromptDataset, shard_by: str) -> tuple[str, str]:
    """(the order used, 'prefix' or 'order'; why), for --shard-by auto|prefix|order."""
    if shard_by != "auto":
        return shard_by, "asked for"
    share = shared_prefix_share(dataset)
    probed = min(dataset.num_rows, PROBE_ROWS)
    why = f"auto: {share:.0%} of the first {probed} rows share their first {PROBE_BYTES} bytes with another"
    return ("prefix" if share >= PROBE_SHARE else "order"), why


def lane_split(indices: list[int], lanes: int) -> list[list[int]]:
    """Shard `indices` cut into at most `lanes` contiguous runs, their sizes within one of each other:
    in prefix order, each lane (one worker process) meets the fewest prefixes."""
    lanes = max(1, min(lanes, len(indices)))
    bounds = [len(indices) * k // lanes for k in range(lanes + 1)]
    return [indices[a:b] for a, b in zip(bounds, bounds[1:])]


def _sorted_rows(dataset: PromptDataset, tmp: str) -> np.ndarray:
    """The input row numbers in the order of their keys (ties in input order); DuckDB sorts, spilling."""
    import duckdb

    schema = pa.schema([("key", pa.binary()), ("row", pa.int64())])

    def batches():
        offset = 0
        for piece in dataset.pieces(0, dataset.num_rows):
            yield pa.record_batch([leading_text(piece, dataset.prompt_column),
                                   pa.array(np.arange(offset, offset + piece.num_rows), pa.int64())], schema=schema)
            offset += piece.num_rows

    con = duckdb.connect(config={"memory_limit": SORT_MEMORY, "temp_directory": tmp})
    try:
        con.register("keys", pa.RecordBatchReader.from_batches(schema, batches()))
        rows = con.sql("SELECT row FROM keys ORDER BY key, row").to_arrow_table().column(0)
    finally:
        con.close()
    return rows.to_numpy()


def stage(dataset: PromptDataset, store: Store, shard_size: int, fingerprint: str) -> dict:
    """Write the input, sorted by leading text, to the run's ROWS_FILE (one row group per shard), then
    PLAN_FILE naming it. Returns the plan."""
    n = dataset.num_rows
    part_rows = max(shard_size, PARTITION_ROWS // shard_size * shard_size)  # whole shards per partition
    with tempfile.TemporaryDirectory(prefix="batchgen-plan-") as tmp:
        order = _sorted_rows(dataset, tmp)
        position = np.empty(n, np.int64)
        position[order] = np.arange(n, dtype=np.int64)
        del order
        writers: dict[int, pq.ParquetWriter] = {}
        offset = 0
        try:
            for piece in dataset.pieces(0, n):
                rows = np.arange(offset, offset + piece.num_rows, dtype=np.int64)
                offset += piece.num_rows
                pos = position[rows]
                piece = piece.append_column(ROW, pa.array(rows)).append_column("_pos", pa.array(pos))
                dest = pos // part_rows
                for d in np.unique(dest):
                    if d not in writers:
                        writers[d] = pq.ParquetWriter(f"{tmp}/part-{d:06d}.parquet", piece.schema)
                    writers[d].write_table(piece.take(pa.array(np.nonzero(dest == d)[0])))
        finally:
            for w in writers.values():
                w.close()
        staged = Path(tmp) / "rows.parquet"
        out = None
        try:
            for d in sorted(writers):
                part = pq.read_table(f"{tmp}/part-{d:06d}.parquet")
                part = part.take(pc.sort_indices(part, [("_pos", "ascending")])).drop_columns(["_pos"])
                out = out or pq.ParquetWriter(staged, part.schema)
                for lo in range(0, part.num_rows, shard_size):
                    out.write_table(part.slice(lo, shard_size), row_group_size=shard_size)
        finally:
            if out is not None:
                out.close()
        plan = {"shard_by": "prefix", "rows": n, "shard_size": shard_size, "input_fingerprint": fingerprint,
                "key_bytes": KEY_BYTES, "size": staged.stat().st_size, "sha256": sha256_file(staged)}
        store.put_file(ROWS_FILE, staged)
    store.write(PLAN_FILE, json.dumps(plan, indent=2).encode())
    return plan


def ensure(dataset: PromptDataset, store: Store, shard_size: int, fingerprint: str) -> PromptDataset:
    """The dataset in prefix order: the run's staged file if it is there and checks out (size and sha256,
    same input, by its `fingerprint`, and shard size), else staged now. Called under the run's lease
    (runner.open_run, which has fingerprinted the input already: that reads every file whole)."""
    if store.exists(PLAN_FILE):
        plan = json.loads(store.read_bytes(PLAN_FILE))
        same = plan.get("input_fingerprint") == fingerprint and plan.get("shard_size") == shard_size \
            and plan.get("key_bytes") == KEY_BYTES
        if same and store.exists(ROWS_FILE) and store.size(ROWS_FILE) == plan["size"] \
                and store.sha256(ROWS_FILE) == plan["sha256"]:
            return dataset.ordered_by(store.path(ROWS_FILE))
        store.delete(PLAN_FILE)  # damaged or stale: stage again (the same input gives the same file)
    stage(dataset, store, shard_size, fingerprint)
    return dataset.ordered_by(store.path(ROWS_FILE))


def planned(dataset: PromptDataset, store: Store, shard_by: str) -> PromptDataset:
    """The dataset as a worker reads it, for a run whose order is `shard_by` ('prefix' or 'order', as its
    identity records): the staged file, checked by size here (open_run checked its sha256)."""
    if shard_by != "prefix":
        return dataset
    plan = json.loads(store.read_bytes(PLAN_FILE)) if store.exists(PLAN_FILE) else {}
    if not plan or not store.exists(ROWS_FILE) or store.size(ROWS_FILE) != plan["size"]:
        raise PlanError(f"{store.path(ROWS_FILE)} is not the staged order its plan names; run the job again "
                        f"from its flow or CLI, which stages it anew")
    return dataset.ordered_by(store.path(ROWS_FILE))
