"""`python -m batchgen.benchmarks.reuse`: the `--reuse-from` lookup at scale.

Writes an earlier run of N committed rows (default 1,000,000, in shards of 10,000, through the real
commit protocol: manifests and checksums), then times, in this process:
- building the index (batchgen.data.reuse.ReuseIndex: every requests file read and checked, its keys
  into DuckDB on local disk), and the process's peak memory while doing it;
- a new run's lookups, shard by shard (1,000 keys a shard, 90% of them found, the rows copied).
Beside it, the naive peer measured in the same run: every earlier key in a Python set in memory
(what a `--skip-ids`-style filter holds), with its memory. Conditions are printed with the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

import pyarrow as pa

SHARD = 10_000


def _key(i: int) -> str:
    return hashlib.sha256(f"row-{i}".encode()).hexdigest()


def write_earlier_run(path: Path, rows: int) -> None:
    """A committed run of `rows` requests rows with request keys (no engine: the rows' contents are
    made up; the files, manifests and checksums are the real protocol's)."""
    from batchgen.data.run_dir import RunDir
    from batchgen.data.writer import SCHEMAS

    run = RunDir(path)
    run.open({"bench": "reuse"}, {"input": {"rows": rows}})
    try:
        for s, start in enumerate(range(0, rows, SHARD)):
            n = min(SHARD, rows - start)
            ids = [f"r{i}" for i in range(start, start + n)]
            cols = {f.name: pa.nulls(n, f.type) for f in SCHEMAS["requests"]}
            cols.update(id=pa.array(ids), request_key=pa.array([_key(i) for i in range(start, start + n)]),
                        finish_reason=pa.array(["stop"] * n), output_tokens=pa.array([16] * n, pa.int32()),
                        output_token_ids=pa.array([list(range(16))] * n, pa.list_(pa.int32())),
                        text=pa.array([f"an answer of some length, number {i}" for i in range(start, start + n)]))
            tables = {t: SCHEMAS[t].empty_table() for t in SCHEMAS}
            tables["requests"] = pa.table(cols, schema=SCHEMAS["requests"])
            run.commit_shard(s, tables, pa.array(ids))
    finally:
        run.unlock()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def index_phase(earlier: str, shards: int, keys_per_shard: int, rows: int) -> dict:
    """In its own process: build the index, then look a new run's shards up. Peak memory is this
    process's, above what it held before the index."""
    from batchgen.data.reuse import ReuseIndex

    base = _peak_mib()
    t0 = time.perf_counter()
    index = ReuseIndex([earlier])
    build_s, build_peak = time.perf_counter() - t0, _peak_mib() - base
    step = max(1, rows // (shards * keys_per_shard))
    times, found = [], 0
    try:
        for s in range(shards):
            keys = [_key((s * keys_per_shard + j) * step % rows) if j % 10 else _key(-1 - s * keys_per_shard - j)
                    for j in range(keys_per_shard)]
            t0 = time.perf_counter()
            found += len(index.lookup(keys))
            times.append(time.perf_counter() - t0)
    finally:
        index.close()
    return {"build_s": build_s, "build_peak": build_peak, "keys": index.num_keys, "times": sorted(times),
            "found": found, "peak": _peak_mib() - base}


def naive_phase(earlier: str) -> dict:
    """In its own process: the naive peer, every earlier key in a Python set (no checksums)."""
    import pyarrow.parquet as pq

    from batchgen.data.run_dir import RunDir

    base = _peak_mib()
    t0 = time.perf_counter()
    run = RunDir(earlier)
    keys = set()
    for rel in (f["path"] for m in run.manifests() for f in m["files"] if f["table"] == "requests"):
        with run.store.open_input(rel) as fh:
            keys.update(pq.read_table(fh, columns=["request_key"]).column("request_key").to_pylist())
    return {"load_s": time.perf_counter() - t0, "keys": len(keys), "peak": _peak_mib() - base}


def _in_process(fn, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fresh process: its peak memory is its own
        return pool.apply(fn, args)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the earlier run")
    p.add_argument("--shards", type=int, default=20, help="shards of the new run looked up")
    p.add_argument("--keys-per-shard", type=int, default=1000)
    args = p.parse_args(argv)

    from batchgen.data.reuse import INDEX_MEMORY_LIMIT
    from batchgen.metrics.conditions import hardware

    with tempfile.TemporaryDirectory(prefix="batchgen-reuse-bench-") as tmp:
        earlier = Path(tmp) / "runs" / "earlier"
        t0 = time.perf_counter()
        _in_process(write_earlier_run, earlier, args.rows)
        write_s = time.perf_counter() - t0
        hw = hardware("cpu")
        print(f"conditions: {args.rows:,} earlier rows in {-(-args.rows // SHARD)} committed shards "
              f"({sum(f.stat().st_size for f in earlier.rglob('*.parquet')) / 2**20:.0f} MiB of requests files, "
              f"written in {write_s:.1f}s); {args.shards} new shards of {args.keys_per_shard} keys, 90% found; "
              f"DuckDB memory limit {INDEX_MEMORY_LIMIT}; {hw.get('cpu')} ({hw.get('cpu_cores')} CPUs)")
        idx = _in_process(index_phase, str(earlier), args.shards, args.keys_per_shard, args.rows)
        naive = _in_process(naive_phase, str(earlier))
    t = idx["times"]
    print(f"index build: {idx['build_s']:.2f}s for {idx['keys']:,} keys (every file's sha256 checked), "
          f"peak memory +{idx['build_peak']:.0f} MiB")
    print(f"lookups: {len(t)} shards, median {1000 * t[len(t) // 2]:.1f} ms, max {1000 * t[-1]:.1f} ms per shard "
          f"of {args.keys_per_shard} keys; {idx['found']:,} rows found and copied; peak memory +{idx['peak']:.0f} MiB")
    print(f"naive peer, every key in a Python set (no checksums): {naive['load_s']:.2f}s to load {naive['keys']:,} "
          f"keys, peak memory +{naive['peak']:.0f} MiB")
    print(f"ratios: build time {idx['build_s'] / naive['load_s']:.2f}x the naive load; "
          f"peak memory {idx['peak'] / max(naive['peak'], 1):.2f}x the naive peer's")


if __name__ == "__main__":
    main()
