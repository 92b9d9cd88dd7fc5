"""An A/B of the native engine's attention backend and Inductor's C++ wrapper, in one process: each
variant's engine is built (and its step compiled) first, then the variants are measured in turn,
`--repeats` times, and the median kept, so a shared machine's drift falls on all of them.

    python -m batchgen.benchmarks.step_ab --batch 1 --quantization gguf --variants torch/0,cpu/0,cpu/1s
    python -m batchgen.benchmarks.step_ab --batch 64 --dtype bfloat16

A variant is BACKEND/CPP_WRAPPER[/static]: the attention backend (torch, cpu) and, for the compiled
step's wrapper, 0 (Python), 1 (C++, one file with the kernels, all at -O3) or 1s (C++, the wrapper at -O1
apart from the kernels: Inductor's cpp_wrapper_build_separate, the engine's default); `static` keeps the
number of attention pairs a static size (a compile per pairs bucket; the engine's default makes it
dynamic). The warm-up generates as many tokens as a measured run, so every bucket a run reaches is
compiled before the runs. Prints the compiles, tok/s with prefill, decode-only and prefill tok/s, and
whether each variant's greedy tokens are the first variant's.

    python -m batchgen.benchmarks.step_ab --batch 1 --quantization gguf --variants cpu/1s,cpu/1s/static
"""

from __future__ import annotations

import argparse
import statistics
import time

from batchgen.config import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    from batchgen.benchmarks import bench
    from batchgen.config import EngineConfig, SamplingParams, cap_cpu_libraries
    from batchgen.engine import create_engine
    from batchgen.engine.decode_graphs import STEP_OPTIONS, DecodeGraphs
    from batchgen.metrics.conditions import cpu_features, cpu_model
    from batchgen.model.prepare import resolve_model

    cap_cpu_libraries()  # as the CLI does: ATEN_CPU_CAPABILITY's cap for oneDNN and MKL too

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    p.add_argument("--variants", default="torch/0,cpu/0,cpu/1s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model", default=DEFAULT_MODEL)
    a = p.parse_args(argv)
    model = resolve_model(a.model)
    from batchgen.model.tokenizer import Tokenizer

    ids = bench.held_prompt_ids(Tokenizer(model), a.batch)  # the bench's chat prompts
    print(f"step A/B, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()} ({cpu_features()}); batch {a.batch}, "
          f"dtype {a.dtype}, quantization {a.quantization}, {a.new_tokens} new tokens, greedy, EOS ignored, "
          f"median of {a.repeats}")
    engines = {}
    for variant in a.variants.split(","):
        backend, wrapper, *static = variant.split("/")
        cfg = EngineConfig(max_num_seqs=a.batch, max_model_len=2048, dtype=a.dtype, quantization=a.quantization,
                           compile="on", kv_cache_tokens=a.batch * 600 + 2048, enable_prefix_caching=False,
                           attention_backend=backend)
        e = create_engine("native", model, cfg)
        g = e.runner.graphs  # its buckets compile on first use: rebuilt here with this variant's options
        e.runner.graphs = DecodeGraphs(g.model, g.kv, g.attention, g.scratch, g.device, g.mode, 0.0,
                                       step_options={**STEP_OPTIONS, "cpp_wrapper": wrapper in ("1", "1s"),
                                                     "cpp_wrapper_build_separate": wrapper == "1s"},
                                       dynamic_pairs=static != ["static"])
        t0 = time.perf_counter()
        bench.run_engine(e, ids, a.batch, SamplingParams(max_tokens=a.new_tokens, ignore_eos=True), None, "warm")
        print(f"  {variant}: warm-up {time.perf_counter() - t0:.1f} s, {e.runner.graphs.num_compiles} compiles "
              f"({e.runner.graphs.compile_s:.1f} s)", flush=True)
        engines[variant] = e
    runs: dict[str, list] = {v: [] for v in engines}
    outputs = {}
    for _ in range(a.repeats):
        for variant, e in engines.items():
            m = bench.run_engine(e, ids, a.batch, SamplingParams(max_tokens=a.new_tokens, ignore_eos=True), None, "m")
            runs[variant].append((m["tokens"] / m["seconds"], m["decode_tok_per_s"], m["prefill_tok_per_s"]))
            outputs[variant] = m["outputs"]
    first = next(iter(outputs.values()))
    print(f"{'variant':<10} {'tok/s':>8} {'dec tok/s':>10} {'pre tok/s':>10}  same tokens as the first")
    for variant, rows in runs.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"{variant:<10} {med[0]:>8.1f} {med[1]:>10.1f} {med[2]:>10.1f}  {outputs[variant] == first}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
