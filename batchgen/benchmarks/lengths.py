"""`python -m batchgen.benchmarks.lengths`: length-aware admission on rows of mixed output lengths.

The workload: 320 chat prompts (the held prompts), most allowed 16 new tokens and one in seven allowed
128 (a `max_tokens` column; EOS ignored, so each row runs to its limit), in random order,
`--max-num-seqs 16`, shards of 80. Continuous batching refills a finished row's slot at once, so the
loss is at each shard's end: a long row admitted late runs on while the batch empties. Each variant is
a real `batchgen generate` (in this process) over the same rows, measured from its own run directory:

    variant        rows                    --admission
    sorted         longest first, by hand  fifo           the best a person does
    fifo           random                  fifo           first come, first served
    prefix         random                  prefix         the default (no shared prefixes here)
    length         random                  length         the longest allowed output first
    prefix-length  random                  prefix-length  cached blocks first, then length

Printed per variant: output tok/s over the steps' window, the window's seconds, the share of it spent
in the tail (steps with no waiting row and fewer than half of max_num_seqs running), and the mean
number of running rows per step; each the median of `--repeats` (after an untimed warm-up run, the
variants taking turns in each repeat), with ratios against sorted and against fifo, and the run
conditions. Speed is noisy on a shared machine; the tail share and the mean batch are steadier.
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

VARIANTS = (("sorted", "fifo"), ("fifo", "fifo"), ("prefix", "prefix"), ("length", "length"),
            ("prefix-length", "prefix-length"))
TAIL_SQL = """
select count(*) as steps, max(end_t) - min(start_t) as window_s, avg(num_running) as mean_running,
       sum(end_t - start_t) filter (where num_waiting = 0 and num_running < {half}) / sum(end_t - start_t) as tail
from steps
"""


def workload(rows: int, short: int, long: int, every: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(rows in random order, the same rows longest first), each {id, prompt, max_tokens}."""
    from batchgen.benchmarks.bench import held_prompts

    texts = held_prompts(rows)
    rng = random.Random(seed)
    items = [{"id": f"r{i:04d}", "prompt": texts[i % len(texts)], "max_tokens": long if i % every == 0 else short}
             for i in range(rows)]
    rng.shuffle(items)
    return items, sorted(items, key=lambda r: -r["max_tokens"])  # stable: random order within a length


def run_variant(rows: list[dict], out: Path, run_id: str, admission: str, args) -> dict:
    from batchgen.config import EngineConfig, RunConfig, SamplingParams
    from batchgen.report.queries import connect, run_query
    from batchgen.runner import generate

    inp = out / f"{run_id}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(out), run_id=run_id, model=args.model,
                    shard_size=args.shard_size, shard_by="order", progress=False,
                    sampling=SamplingParams(max_tokens=args.long, ignore_eos=True),
                    engine_config=EngineConfig(max_num_seqs=args.max_num_seqs, admission=admission))
    summary = generate(cfg, probe=False)
    con = connect([summary.run_dir])
    (tp,) = run_query(con, "throughput").to_pylist()
    (cond,) = run_query(con, "run_conditions").to_pylist()
    (tail,) = con.sql(TAIL_SQL.format(half=args.max_num_seqs / 2)).to_arrow_table().to_pylist()
    return {"tok_s": tp["output_tok_per_s"], "window_s": tail["window_s"], "tail": tail["tail"] or 0.0,
            "mean_running": tail["mean_running"], "conditions": cond}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=320)
    p.add_argument("--shard-size", type=int, default=80)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--short", type=int, default=16, help="new tokens of most rows")
    p.add_argument("--long", type=int, default=128, help="new tokens of one row in --every")
    p.add_argument("--every", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=DEFAULT_MODEL)
    args = p.parse_args(argv)

    shuffled, longest_first = workload(args.rows, args.short, args.long, args.every)
    got: dict[str, list[dict]] = {name: [] for name, _ in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="batchgen-lengths-bench-") as tmp:
        run_variant(longest_first[:2 * args.max_num_seqs], Path(tmp), "warm-up", "fifo", args)  # untimed
        for rep in range(args.repeats):  # the variants take turns in each repeat
            for name, admission in VARIANTS:
                rows = longest_first if name == "sorted" else shuffled
                got[name].append(run_variant(rows, Path(tmp), f"{name}-{rep}", admission, args))
    c = got["sorted"][0]["conditions"]
    n_long = sum(r["max_tokens"] == args.long for r in shuffled)
    print(f"conditions: {args.rows} chat prompts, {n_long} allowed {args.long} new tokens and the rest {args.short} "
          f"(EOS ignored), max_num_seqs {args.max_num_seqs}, shards of {args.shard_size}; {c.get('engine')} "
          f"{c.get('dtype')} on {c.get('device_name')} ({c.get('cpu_cores')} cores); median of {args.repeats} "
          f"repeats, variants interleaved")
    keys = ("tok_s", "window_s", "tail", "mean_running")
    med = {name: {k: statistics.median(r[k] for r in runs) for k in keys} for name, runs in got.items()}
    print(f"{'rows / admission':<30}{'output tok/s':>13}{'window s':>10}{'tail':>7}{'mean running':>14}"
          f"{'tok/s vs sorted':>17}{'tok/s vs fifo':>15}")
    for name, admission in VARIANTS:
        m = med[name]
        label = f"{'longest first' if name == 'sorted' else 'random'} / {admission}"
        print(f"{label:<30}{m['tok_s']:>13.1f}{m['window_s']:>10.2f}{m['tail']:>6.0%}{m['mean_running']:>14.1f}"
              f"{m['tok_s'] / med['sorted']['tok_s']:>16.2f}x{m['tok_s'] / med['fifo']['tok_s']:>14.2f}x")
    for name in ("length", "prefix-length"):
        ratio = med[name]["tok_s"] / med["prefix"]["tok_s"]
        print(f"{name} admission / the default (prefix): {ratio:.2f}x tok/s "
              f"({'a win' if ratio > 1 else 'a slow-down'}), tail {med[name]['tail']:.0%} vs "
              f"{med['prefix']['tail']:.0%}")


if __name__ == "__main__":
    main()
