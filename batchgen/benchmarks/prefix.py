"""`python -m batchgen.benchmarks.prefix`: the order of a dataset whose rows share system prompts.

The workload (issue #27's): 320 rows, each with one of 8 system prompts of about 250 tokens and a short
question (the held prompts), 16 new tokens, `--kv-cache-tokens 2048`, `--max-num-seqs 16`, shards of
80. Each variant is a real run (open_run, each shard on a worker's engine, finalize) over the same rows,
measured from its own run directory:

    variant          rows     --shard-by   --admission
    sorted           by hand  order        fifo          the best a person does
    fifo             random   order        fifo          what batchgen did before (#27)
    admission        random   order        prefix        prefix-aware admission within a shard
    prefix           random   prefix       prefix        the default: prefix-ordered shards as well

with 1 worker and with 2. Two workers are two engines (each its own KV pool and prefix cache) in this
process, taking the shards in turn: one task per shard alternates between them, as Ray deals per-shard
tasks; a prefix-ordered run gives each a contiguous lane of shards (flows/generate.py). They take turns
on this machine's cores, so the tok/s of 2 workers says what order costs, not what a second machine adds.

Printed per variant: prompt tokens computed (the prefill the steps ran, prefix-cache hits excluded; exact)
and output tok/s over the steps' window (noisy on a shared machine), each the median of `--repeats`
(after an untimed warm-up run, the variants taking turns in each repeat), with ratios against sorted and
against fifo, and the run conditions. Then the cost of staging the prefix order: `--stage-rows` rows
(1,000,000 by default) staged in a fresh process, its time and peak memory.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config import DEFAULT_MODEL

N_SYSTEMS = 8
SYSTEM_WORDS = 190  # ~250 tokens with SmolLM2's tokenizer


def workload(rows: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(rows in random order, the same rows sorted by system prompt), each {id, system, prompt}."""
    from batchgen.benchmarks.bench import held_prompts

    texts = held_prompts(175)
    words = " ".join(texts).split()
    systems = [f"You are assistant number {k}. Follow these house rules and examples exactly. "
               + " ".join(words[k * SYSTEM_WORDS:(k + 1) * SYSTEM_WORDS]) for k in range(N_SYSTEMS)]
    questions = sorted((t for t in texts if len(t.split()) <= 20), key=len)
    rng = random.Random(seed)
    items = [{"id": f"r{i:04d}", "system": systems[rng.randrange(N_SYSTEMS)],
              "prompt": questions[i % len(questions)]} for i in range(rows)]
    shuffled = items[:]
    rng.shuffle(shuffled)
    by_system = sorted(items, key=lambda r: (systems.index(r["system"]), r["id"]))
    return shuffled, by_system


VARIANTS = (("sorted", "order", "fifo"), ("fifo", "order", "fifo"), ("admission", "order", "prefix"),
            ("prefix", "prefix", "prefix"))
LABELS = {"sorted": "sorted by hand", "fifo": "random, as before", "admission": "random, prefix admission",
          "prefix": "random, prefix shards"}


def run_variant(rows: list[dict], out: Path, run_id: str, shard_by: str, admission: str, workers: int, args) -> dict:
    """One run of `rows` on `workers` fresh engines, its shards dealt as the flow deals them."""
    from batchgen.config import EngineConfig, RunConfig, SamplingParams
    from batchgen.data.order import lane_split
    from batchgen.report.queries import connect, run_query
    from batchgen.runner import finalize, open_run, run_shard_in_worker
    from batchgen.worker import Worker

    inp = out / f"{run_id}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(out), run_id=run_id, model=args.model,
                    shard_size=args.shard_size, shard_by=shard_by, progress=False,
                    sampling=SamplingParams(max_tokens=args.new_tokens, ignore_eos=True),
                    engine_config=EngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
                                               admission=admission))
    opened = open_run(cfg)
    shards = list(range(opened.num_shards))
    if opened.shard_by == "prefix":  # lanes of adjacent shards
        deal = {i: w for w, lane in enumerate(lane_split(shards, workers)) for i in lane}
    else:  # per-shard tasks, dealt in turn
        deal = {i: i % workers for i in shards}
    engines = [Worker() for _ in range(workers)]
    try:
        for i in shards:
            run_shard_in_worker(cfg, str(opened.run.path), i, engines[deal[i]])
        finalize(opened)
    finally:
        for w in engines:
            if w.engine is not None:
                w.drop_engine(w.engine)
    con = connect([str(opened.run.path)])
    (kv,) = run_query(con, "kv_cache").to_pylist()
    (tp,) = run_query(con, "throughput").to_pylist()
    (cond,) = run_query(con, "run_conditions").to_pylist()
    return {"computed": kv["prefill_tokens_computed"], "cached": kv["prefix_cached_tokens"],
            "tok_s": tp["output_tok_per_s"], "conditions": cond}


def write_stage_input(rows: int, tmp: str) -> tuple[str, int]:
    """`rows` rows of the workload's shape (8 system prompts, a question each), written in pieces;
    (its path, the bytes of its text)."""
    shuffled, _ = workload(2000)
    path = Path(tmp) / "stage-input.parquet"
    writer, text = None, 0
    for lo in range(0, rows, 50_000):
        n = min(50_000, rows - lo)
        t = pa.table({"id": [f"s{i:08d}" for i in range(lo, lo + n)],
                      "system": [shuffled[i % 2000]["system"] for i in range(lo, lo + n)],
                      "prompt": [f"{shuffled[i % 2000]['prompt']} ({i})" for i in range(lo, lo + n)]})
        writer = writer or pq.ParquetWriter(path, t.schema)
        writer.write_table(t)
        text += t.column("system").nbytes + t.column("prompt").nbytes
    writer.close()
    return str(path), text


def stage_cost(path: str, text_bytes: int, tmp: str) -> dict:
    """In a fresh process: stage the input at `path` in prefix order; seconds, and peak memory before
    and after (what the input's validation held, then the staging's own peak above it)."""
    import resource
    import time

    from batchgen.data import order
    from batchgen.data.fs import Store
    from batchgen.data.reader import PromptDataset

    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    dataset = PromptDataset([path])  # validation reads the id column (as every run does)
    base = peak()
    t0 = time.perf_counter()
    plan = order.stage(dataset, Store(Path(tmp) / "stage-run"), 1000, dataset.fingerprint())
    return {"rows": dataset.num_rows, "s": time.perf_counter() - t0, "base": base, "peak": peak() - base,
            "input_mib": Path(path).stat().st_size / 2**20, "raw_mib": text_bytes / 2**20, "staged_mib": plan["size"] / 2**20}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=320)
    p.add_argument("--shard-size", type=int, default=80)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--stage-rows", type=int, default=1_000_000, help="rows staged to time the prefix order (0: skip)")
    p.add_argument("--only-stage", action="store_true", help="measure the staging alone, not the runs")
    args = p.parse_args(argv)

    shuffled, by_system = workload(args.rows)
    inputs = {"sorted": by_system}
    cells = [(name, w) for w in args.workers for name, _, _ in VARIANTS]
    got: dict[tuple[str, int], list[dict]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory(prefix="batchgen-prefix-bench-") as tmp:
        if args.only_stage:
            args.repeats, args.stage_rows = 0, args.stage_rows or 1_000_000
        # untimed: the machine's first engine compiles its decode buckets (later ones find Inductor's cache)
        if args.repeats:
            run_variant(by_system[:2 * args.max_num_seqs], Path(tmp), "warm-up", "order", "fifo", 1, args)
        for rep in range(args.repeats):  # the variants take turns in each repeat
            for name, shard_by, admission in VARIANTS:
                for w in args.workers:
                    got[(name, w)].append(run_variant(inputs.get(name, shuffled), Path(tmp), f"{name}-{w}-{rep}",
                                                      shard_by, admission, w, args))
        staged = None
        if args.stage_rows:
            import multiprocessing

            path, text = write_stage_input(args.stage_rows, tmp)
            with multiprocessing.get_context("spawn").Pool(1) as pool:  # its peak memory is its own
                staged = pool.apply(stage_cost, (path, text, tmp))
        if args.only_stage:
            print(_staged_line(staged))
            return
    c = got[cells[0]][0]["conditions"]
    print(f"conditions: {args.rows} rows, {N_SYSTEMS} system prompts of ~250 tokens, {args.new_tokens} new tokens, "
          f"max_num_seqs {args.max_num_seqs}, kv_cache_tokens {args.kv_cache_tokens}, shards of {args.shard_size}; "
          f"{c.get('engine')} {c.get('dtype')} on {c.get('device_name')} ({c.get('cpu_cores')} cores); "
          f"median of {args.repeats} repeats, variants interleaved; 2 workers take turns on the same cores")
    med = {cell: {k: statistics.median(r[k] for r in runs) for k in ("computed", "cached", "tok_s")}
           for cell, runs in got.items()}
    print(f"{'rows':<27}{'workers':>8}{'prompt tokens computed':>24}{'cached':>9}{'output tok/s':>14}"
          f"{'computed vs sorted':>20}{'tok/s vs sorted':>17}{'tok/s vs before':>17}")
    for name, w in cells:
        m, base, before = med[(name, w)], med[("sorted", w)], med[("fifo", w)]
        print(f"{LABELS[name]:<27}{w:>8}{m['computed']:>24.0f}{m['cached']:>9.0f}{m['tok_s']:>14.1f}"
              f"{m['computed'] / base['computed']:>19.2f}x{m['tok_s'] / base['tok_s']:>16.2f}x"
              f"{m['tok_s'] / before['tok_s']:>16.2f}x")
    for w in args.workers:
        for name in ("admission", "prefix"):
            ratio = med[(name, w)]["computed"] / med[("sorted", w)]["computed"]
            speed = med[(name, w)]["tok_s"] / med[("sorted", w)]["tok_s"]
            print(f"targets, {LABELS[name]}, {w} worker{'s' if w > 1 else ''}: {ratio:.2f}x the hand-sorted prompt "
                  f"tokens (<= 1.15x) {'met' if ratio <= 1.15 else 'MISSED'}; {speed:.2f}x its tok/s (>= 0.95x) "
                  f"{'met' if speed >= 0.95 else 'MISSED'}")
    if staged:
        print(_staged_line(staged))


def _staged_line(staged: dict) -> str:
    return (f"staging the prefix order of {staged['rows']:,} rows ({staged['input_mib']:.0f} MiB of Parquet, "
            f"{staged['raw_mib']:.0f} MiB of text; shards of 1000): {staged['s']:.1f} s, peak memory "
            f"+{staged['peak']:.0f} MiB over the {staged['base']:.0f} MiB the process held after validation; "
            f"staged file {staged['staged_mib']:.0f} MiB (one run)")

if __name__ == "__main__":
    main()
