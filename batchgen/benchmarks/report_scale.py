"""How `batchgen report` scales: time and peak memory on a synthetic run with N token rows.

    python -m batchgen.benchmarks.report_scale --tokens 100000000 --dir /tmp/bigrun

The timing tables are generated synthetically (numpy + pyarrow, shard by shard) with the real schema,
then `batchgen report` runs in a child process so its peak RSS can be read on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.writer import SCHEMAS
from batchgen.metrics.conditions import cpu_model

TOKENS_PER_REQUEST = 250
BATCH = 64  # sequences per synthetic step


def write_shard(run: Path, shard: int, num_tokens: int, rng: np.random.Generator, t0: float) -> float:
    name = f"shard={shard:05d}"
    n_req = num_tokens // TOKENS_PER_REQUEST
    ids = pa.array([f"s{shard}-r{i}" for i in range(n_req)], pa.string())
    prompt = rng.integers(16, 1024, n_req)
    # requests run in waves of BATCH: each wave takes TOKENS_PER_REQUEST steps
    steps_per_wave = TOKENS_PER_REQUEST
    n_waves = -(-n_req // BATCH)
    n_steps = n_waves * steps_per_wave
    step_s = rng.gamma(20.0, 0.2 / 20.0, n_steps)  # about 0.2 s per decode step
    end_t = t0 + np.cumsum(step_s)
    start_t = end_t - step_s
    req_idx = np.repeat(np.arange(n_req), TOKENS_PER_REQUEST)
    tok_idx = np.tile(np.arange(TOKENS_PER_REQUEST), n_req)
    step_of = (req_idx // BATCH) * steps_per_wave + tok_idx
    t = end_t[step_of]
    itl = np.where(tok_idx == 0, np.nan, t - end_t[np.maximum(step_of - 1, 0)])
    tokens = pa.table({
        "request_id": ids.take(pa.array(req_idx)), "token_index": pa.array(tok_idx, pa.int32()),
        "step_id": pa.array(step_of + 1, pa.int64()), "t": pa.array(t),
        "itl_s": pa.array(itl, from_pandas=True), "context_len": pa.array(prompt[req_idx] + tok_idx, pa.int32()),
        "concurrency": pa.array(np.full(len(t), BATCH), pa.int32()),
        "token_id": pa.array(rng.integers(0, 49152, len(t)), pa.int32()),
    }, schema=SCHEMAS["tokens"])
    first = end_t[(np.arange(n_req) // BATCH) * steps_per_wave]
    last = end_t[(np.arange(n_req) // BATCH) * steps_per_wave + TOKENS_PER_REQUEST - 1]
    sched = first - 0.5
    enq = np.full(n_req, t0)
    requests = pa.table({
        "id": ids, "prompt_tokens": pa.array(prompt, pa.int32()),
        "output_tokens": pa.array(np.full(n_req, TOKENS_PER_REQUEST), pa.int32()),
        "output_token_ids": pa.array([[]] * n_req, pa.list_(pa.int32())), "text": pa.array([""] * n_req),
        "finish_reason": pa.array(["length"] * n_req), "enqueue_t": enq, "schedule_t": sched,
        "first_token_t": first, "last_token_t": last, "queue_s": sched - enq, "ttft_s": first - enq,
        "prefill_s": first - sched, "tpot_s": (last - first) / (TOKENS_PER_REQUEST - 1), "e2e_s": last - enq,
        "prompt_truncated_from": pa.nulls(n_req, pa.int32()),
    }, schema=SCHEMAS["requests"])
    steps = pa.table({
        "step_id": pa.array(np.arange(1, n_steps + 1), pa.int64()), "start_t": start_t, "end_t": end_t,
        "num_running": pa.array(np.full(n_steps, BATCH), pa.int32()),
        "num_waiting": pa.array(np.zeros(n_steps), pa.int32()),
        "num_prefill_tokens": pa.array(np.zeros(n_steps), pa.int32()),
        "num_decode_tokens": pa.array(np.full(n_steps, BATCH), pa.int32()),
        "sum_context_len": pa.array(np.full(n_steps, BATCH * 600), pa.int64()),
        "bytes_read": pa.array(np.full(n_steps, 560_000_000), pa.int64()),
    }, schema=SCHEMAS["steps"])
    for tname, tab in (("tokens", tokens), ("requests", requests), ("steps", steps),
                       ("errors", SCHEMAS["errors"].empty_table())):
        (run / tname / name).mkdir(parents=True, exist_ok=True)
        pq.write_table(tab, run / tname / name / "part-0.parquet", compression="zstd")
    return float(end_t[-1])


def make_run(run: Path, num_tokens: int, shard_tokens: int) -> None:
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    doc = {"run_id": run.name, "identity": {"sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                                          "max_tokens": TOKENS_PER_REQUEST}},
           "conditions": {"engine": {"engine": "synthetic", "dtype": "float32", "max_num_seqs": BATCH},
                          "hardware": {"cpu": "synthetic", "peak_read_bytes_per_s": 2.4e10}}}
    (run / "run.json").write_text(json.dumps(doc))
    rng = np.random.default_rng(0)
    t = 0.0
    for shard in range(-(-num_tokens // shard_tokens)):
        t = write_shard(run, shard, min(shard_tokens, num_tokens - shard * shard_tokens), rng, t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--shard-tokens", type=int, default=5_000_000)
    ap.add_argument("--dir", default="/tmp/batchgen-report-scale")
    ap.add_argument("--memory-limit", default="4GB")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    run = Path(args.dir) / "synthetic"
    t0 = time.perf_counter()
    make_run(run, args.tokens, args.shard_tokens)
    gen_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in run.rglob("*.parquet"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "batchgen.cli", "report", str(run), "--out", str(run / "report"),
                           "--memory-limit", args.memory_limit], capture_output=True, text=True)
    report_s = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if proc.returncode:
        sys.exit(proc.stderr)
    print(f"conditions: {cpu_model()}, {os.cpu_count()} cores, duckdb memory_limit={args.memory_limit}, "
          f"{args.tokens:,} token rows, {args.tokens // TOKENS_PER_REQUEST:,} requests, "
          f"{size / 2**20:,.0f} MiB of Parquet")
    print(f"synthetic data written in {gen_s:.1f} s")
    print(f"batchgen report: {report_s:.1f} s wall, peak RSS {peak_mib:,.0f} MiB "
          f"({args.tokens / report_s / 1e6:.2f} M token rows/s)")
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    main()
