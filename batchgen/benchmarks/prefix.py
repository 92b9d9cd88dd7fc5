"""`python -m batchgen.benchmarks.prefix`: the order of a dataset whose rows share system prompts.

The workload (issue #27's): 320 rows, each with one of 8 system prompts of about 250 tokens and a short
question (the held prompts), 16 new tokens, `--kv-cache-tokens 2048`, `--max-num-seqs 16`, shards of
80. Each variant is a real `batchgen generate` (in this process, one engine per variant) over the same
rows, measured from its own run directory:

- sorted:  the rows sorted by system prompt by hand, first-come admission (the best a person does);
- fifo:    the rows in random order, first-come admission (what batchgen did before);
- prefix:  the rows in random order, prefix-aware admission (`--admission prefix`, the default).

Printed per variant: prompt tokens computed (the prefill the steps ran, prefix-cache hits excluded)
and output tok/s over the steps' window, each the median of `--repeats` (after an untimed warm-up
run), with ratios against sorted and against fifo, and the run conditions. Speed is noisy on a shared machine: the computed tokens are
exact, the tok/s are not.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

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


def run_variant(rows: list[dict], out: Path, run_id: str, admission: str, args) -> dict:
    from batchgen.config import EngineConfig, RunConfig, SamplingParams
    from batchgen.report.queries import connect, run_query
    from batchgen.runner import generate

    inp = out / f"{run_id}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(out), run_id=run_id, model=args.model,
                    shard_size=args.shard_size, progress=False,
                    sampling=SamplingParams(max_tokens=args.new_tokens, ignore_eos=True),
                    engine_config=EngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens,
                                               admission=admission))
    summary = generate(cfg, probe=False)
    con = connect([summary.run_dir])
    (kv,) = run_query(con, "kv_cache").to_pylist()
    (tp,) = run_query(con, "throughput").to_pylist()
    (cond,) = run_query(con, "run_conditions").to_pylist()
    return {"computed": kv["prefill_tokens_computed"], "cached": kv["prefix_cached_tokens"],
            "tok_s": tp["output_tok_per_s"], "conditions": cond}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=320)
    p.add_argument("--shard-size", type=int, default=80)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)

    shuffled, by_system = workload(args.rows)
    variants = (("sorted", by_system, "fifo"), ("fifo", shuffled, "fifo"), ("prefix", shuffled, "prefix"))
    got: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory(prefix="batchgen-prefix-bench-") as tmp:
        # untimed: the machine's first engine compiles its decode buckets (later ones find Inductor's cache)
        run_variant(by_system[:2 * args.max_num_seqs], Path(tmp), "warm-up", "fifo", args)
        for rep in range(args.repeats):  # the variants take turns in each repeat
            for name, rows, admission in variants:
                got[name].append(run_variant(rows, Path(tmp), f"{name}-{rep}", admission, args))
    c = got["sorted"][0]["conditions"]
    print(f"conditions: {args.rows} rows, {N_SYSTEMS} system prompts of ~250 tokens, {args.new_tokens} new tokens, "
          f"max_num_seqs {args.max_num_seqs}, kv_cache_tokens {args.kv_cache_tokens}, shards of {args.shard_size}; "
          f"{c.get('engine')} {c.get('dtype')} on {c.get('device_name')} ({c.get('cpu_cores')} cores); "
          f"median of {args.repeats} repeats, variants interleaved")
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("computed", "cached", "tok_s")}
           for name, runs in got.items()}
    print(f"{'order / admission':<28}{'prompt tokens computed':>24}{'cached':>9}{'output tok/s':>14}"
          f"{'computed vs sorted':>20}{'tok/s vs sorted':>17}{'tok/s vs fifo':>15}")
    labels = {"sorted": "sorted by hand / fifo", "fifo": "random / fifo (before)", "prefix": "random / prefix"}
    for name, m in med.items():
        print(f"{labels[name]:<28}{m['computed']:>24.0f}{m['cached']:>9.0f}{m['tok_s']:>14.1f}"
              f"{m['computed'] / med['sorted']['computed']:>19.2f}x{m['tok_s'] / med['sorted']['tok_s']:>16.2f}x"
              f"{m['tok_s'] / med['fifo']['tok_s']:>14.2f}x")
    ratio = med["prefix"]["computed"] / med["sorted"]["computed"]
    speed = med["prefix"]["tok_s"] / med["sorted"]["tok_s"]
    print(f"targets: random order computes {ratio:.2f}x the hand-sorted prompt tokens (target <= 1.15x) "
          f"{'met' if ratio <= 1.15 else 'MISSED'}; reaches {speed:.2f}x its tok/s (target >= 0.95x) "
          f"{'met' if speed >= 0.95 else 'MISSED'}")


if __name__ == "__main__":
    main()
