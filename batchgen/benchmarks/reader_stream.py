"""Peak memory while streaming a large prompt dataset through the reader and input processing.

    python -m batchgen.benchmarks.reader_stream --rows 1000000

Writes a synthetic N-row Parquet file, then walks it shard by shard exactly as `batchgen generate`
does (validation, streaming shards, chat template + tokenization of every row), without generating.
Prints peak RSS against the size the whole table would take in memory, with the conditions.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config import DEFAULT_MODEL, SamplingParams
from batchgen.data.prompts import InputProcessor, PreparedRow
from batchgen.data.reader import PromptDataset
from batchgen.metrics.conditions import cpu_model


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_dataset(path: Path, rows: int, chunk: int = 100_000) -> int:
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("max_tokens", pa.int32())])
    nbytes = 0
    with pq.ParquetWriter(path, schema) as w:
        for s in range(0, rows, chunk):
            n = min(chunk, rows - s)
            t = pa.table({"id": [f"row-{i}" for i in range(s, s + n)],
                          "prompt": [f"Write a short story about a cat number {i}. Keep it under 100 words."
                                     for i in range(s, s + n)],
                          "max_tokens": pa.array([64] * n, pa.int32())}, schema=schema)
            nbytes += t.nbytes
            w.write_table(t)
    return nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    from batchgen.model.prepare import resolve_model
    from batchgen.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.parquet"
        table_bytes = write_dataset(path, args.rows)
        pa.default_memory_pool().release_unused()
        base = rss_mib()
        t0 = time.perf_counter()
        dataset = PromptDataset([str(path)])  # validation reads the id column whole (duplicate check)
        after_validation = rss_mib()
        processor = InputProcessor(tokenizer, 2048, SamplingParams())
        rows = tokens = shards = 0
        for shard in dataset.shards(args.shard_size):
            shards += 1
            for row in shard.table.to_pylist():
                prepared = processor.process(row)
                rows += 1
                if isinstance(prepared, PreparedRow):
                    tokens += len(prepared.prompt_token_ids)
        seconds = time.perf_counter() - t0
        peak = rss_mib()
        print(f"conditions: {cpu_model()}, {os.cpu_count()} cores, {args.rows:,} rows in one Parquet file "
              f"({path.stat().st_size / 2**20:.0f} MiB on disk, {table_bytes / 2**20:.0f} MiB as one Arrow table), "
              f"shard size {args.shard_size}")
        print(f"streamed {rows:,} rows in {shards:,} shards ({tokens:,} prompt tokens) in {seconds:.1f} s")
        print(f"peak RSS {peak:,.0f} MiB: {base:,.0f} before reading, {after_validation:,.0f} after validation "
              f"(the id column), +{peak - after_validation:,.0f} MiB while streaming every shard "
              f"(the whole table would be {table_bytes / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
