"""`python -m batchgen.benchmarks.vllm_wrapper`: vLLM through batchgen against vLLM's own `LLM.generate`.

The same model, dtype, prompts (the bench's few-shot chat prompts, 100-500 tokens), new tokens (greedy, EOS
ignored), max_num_seqs and KV memory, in one process and one run:

- `vLLM LLM.generate`: vLLM's offline API as its users call it, vLLM's defaults (its compiled CPU path);
- `batchgen --engine vllm`: batchgen's VllmEngine with its defaults, stepped as a run steps it, every
  token timed (what `batchgen generate --engine vllm` does per step);
- `batchgen, enforce_eager`: the same with vLLM's eager mode, what batchgen forced on CPU before.

Each is warmed up once at the batch (untimed; its start-up, compile included, is printed), then the
three take turns `--repeats` times, each run on an emptied prefix cache (the repeats send the same
prompts, and a dataset job sends a prompt once); tok/s is output tokens over the seconds from the
batch's first request to its last token, prefill included; the median is kept and the spread printed,
with the ratios against LLM.generate, the share of rows whose tokens equal LLM.generate's, and the run
conditions. `--out` writes the cells as a bench run's Parquet (engines `vllm-generate:<dtype>`, `vllm` and
`vllm:eager`), which `python -m batchgen.benchmarks.judge table` reads beside the bench's own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from batchgen.config import DEFAULT_MODEL

ENGINES = {"vLLM LLM.generate": "vllm-generate", "batchgen --engine vllm": "vllm",  # a variant's engine in --out
           "batchgen, enforce_eager": "vllm:eager"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", help="also write the cells as a bench run's Parquet here")
    args = p.parse_args(argv)

    from batchgen.benchmarks.bench import held_prompt_ids, prompts_text, run_conditions, run_engine
    from batchgen.benchmarks.bench_results import Measurement, verdicts, write_parquet
    from batchgen.benchmarks.peers import VllmOwnRunner, vllm_kv_bytes
    from batchgen.config import EngineConfig, SamplingParams, kv_bytes_per_token
    from batchgen.engine.vllm import VllmEngine
    from batchgen.metrics.conditions import cpu_features, cpu_model
    from batchgen.model.loader import read_hf_shape
    from batchgen.model.prepare import resolve_model
    from batchgen.model.tokenizer import Tokenizer

    model_dir = resolve_model(args.model)
    prompts = held_prompt_ids(Tokenizer(model_dir), args.batch)
    max_len = max(len(q) for q in prompts) + args.new_tokens + 8
    shape = read_hf_shape(model_dir)
    per_token = kv_bytes_per_token(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
                                   4 if args.dtype == "float32" else 2)
    # every row in flight at once, in vLLM's own 128-position blocks; the same room for both
    kv_bytes = vllm_kv_bytes([len(q) for q in prompts], args.new_tokens, per_token)
    kv_tokens = kv_bytes // per_token
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    variants, startup = {}, {}
    t0 = time.perf_counter()
    own = VllmOwnRunner(model_dir, args.dtype, args.batch, max_len, kv_bytes)
    variants["vLLM LLM.generate"] = lambda: own.run(prompts, args.batch, args.new_tokens)
    startup["vLLM LLM.generate"] = time.perf_counter() - t0
    engines = []
    for name, options in (("batchgen --engine vllm", {}), ("batchgen, enforce_eager", {"enforce_eager": True})):
        t0 = time.perf_counter()
        engine = VllmEngine(model_dir, EngineConfig(dtype=args.dtype, max_num_seqs=args.batch, max_model_len=max_len,
                                                    kv_cache_tokens=kv_tokens), options=options)
        engines.append(engine)
        variants[name] = lambda engine=engine, name=name: (  # each run's prompts new to it, as LLM.generate's are
            engine.reset_prefix_cache(), run_engine(engine, prompts, args.batch, params, None, name))[1]
        startup[name] = time.perf_counter() - t0
    timed: dict[str, list[tuple[int, float]]] = {name: [] for name in variants}  # (tokens, seconds) a repeat
    outputs: dict[str, list] = {name: [] for name in variants}
    try:
        for name, run in variants.items():  # warm-up: untimed
            t0 = time.perf_counter()
            run()
            startup[name] += time.perf_counter() - t0
        names = list(variants)
        for rep in range(args.repeats):  # take turns, the order rotating
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                got = variants[name]()
                timed[name].append((got["tokens"], got["seconds"]))
                outputs[name].append(got["outputs"])
    finally:
        for e in engines:
            e.close()
    rates = {name: [t / s for t, s in rs] for name, rs in timed.items()}
    c = engines[0].conditions()
    print(f"conditions: {args.batch} few-shot chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{args.new_tokens} new tokens, greedy, EOS ignored, {args.dtype}, max_num_seqs {args.batch}, KV for every "
          f"row; vLLM {c['engine_version']} on {cpu_model()} ({cpu_features()}); "
          f"median of {args.repeats} repeats, variants taking turns")
    base = statistics.median(rates["vLLM LLM.generate"])
    ref = outputs["vLLM LLM.generate"][0]

    def agree(runs: list) -> float:  # rows whose tokens equal LLM.generate's first repeat's, over the repeats
        pairs = [(a, b) for run in runs for a, b in zip(run, ref)]
        return sum(a == b for a, b in pairs) / len(pairs)

    print(f"{'variant':<26}{'tok/s':>9}{'spread':>9}{'vs LLM.generate':>17}{'start-up s':>12}{'rows as generate':>18}")
    for name, rs in rates.items():
        med = statistics.median(rs)
        runs = outputs[name][1:] if name == "vLLM LLM.generate" else outputs[name]  # its own: against itself
        print(f"{name:<26}{med:>9.1f}{(max(rs) - min(rs)) / med:>8.0%}{med / base:>16.2f}x{startup[name]:>12.1f}"
              f"{agree(runs) if runs else float('nan'):>17.0%}")
    print("rows as generate: greedy rows whose tokens equal LLM.generate's first repeat's (for LLM.generate, its "
          "other repeats': vLLM's bf16 CPU path is not batch-invariant, so a row can change with the step it was "
          "scheduled in)")
    tag = "bf16" if args.dtype == "bfloat16" else "fp32"
    cells = []  # each variant's median repeat, as a bench cell: the target is judged as the bench judges it
    for name, rs in timed.items():
        tokens, seconds = sorted(rs, key=lambda r: r[0] / r[1])[len(rs) // 2]
        cells.append(Measurement(
            "grid", ENGINES[name] + (f":{tag}" if ENGINES[name] == "vllm-generate" else ""), args.dtype,
            args.batch, "greedy", "held", 0, len(prompts), tokens, seconds, repeats=len(rs),
            spread=(max(rates[name]) - min(rates[name])) / (tokens / seconds),
            repeat_tok_per_s=[t / s for t, s in rs],
            # like against like: both on vLLM's own binding (batchgen's vLLM engine keeps vLLM's defaults)
            cores="vLLM's default (one core reserved for its scheduler)"))
    for v in verdicts(cells):
        print(f"target: {v.line.strip()}")
    if args.out:
        conditions = {**run_conditions(model_dir, args.new_tokens, args.repeats), "engine_version": c["engine_version"],
                      "prompts": prompts_text(prompts)}
        print(f"wrote {write_parquet(cells, conditions, Path(args.out))}")


if __name__ == "__main__":
    main()
