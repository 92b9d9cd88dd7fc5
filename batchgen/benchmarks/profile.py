"""Where a step's time goes: the native engine under PyTorch's profiler, at several batch sizes, its
prefill steps and its decode steps apart. Each op's own time (self CPU time) is put in one class:

- GEMM: the matmuls (batchgen's gemv, bgemm and low-bit kernels, oneDNN, int4, aten mm/addmm/linear);
- attention: the paged attention (batchgen's C++ kernel, or the PyTorch path's ops inside it);
- sampling: choosing tokens from logits (argmax, the fused sampler, top-k, softmax);
- fused elementwise: batchgen's one-pass RMSNorm, RoPE and SwiGLU kernels, and the kernels Inductor generated for the
  compiled step (RoPE, KV writes), where the profiler sees them (under Inductor's C++ wrapper it does
  not: they fall in "host");
- other ops: every other op: in the eager (prefill) steps, the norms, RoPE, activations, KV writes,
  copies and indexing one op at a time;
- host: the phase's wall time that no op accounts for: Python (the scheduler, the model runner's
  planning, the output processor), Dynamo's guards, and the compiled step's own fused kernels.

    python -m batchgen.benchmarks.profile --batches 1,64,256

The engine runs with the defaults a user gets (`--dtype auto`, or the dtype `--dtype` names; compile
on after a warm-up that compiles every bucket the measured steps use). The profiler adds its own cost
to each op; the shares are what to read, not the absolute times.
"""

from __future__ import annotations

import argparse
import time

from batchgen.config import DEFAULT_MODEL

CLASSES = ("GEMM", "attention", "sampling", "fused elementwise", "other ops", "host")
GEMM_NAMES = ("gemv", "bgemm", "qgemv", "q4_1", "q8_0", "_weight_int4pack", "mkldnn", "aten::mm", "aten::addmm",
              "aten::linear", "aten::bmm", "aten::matmul")
SAMPLING_NAMES = ("argmax", "batchgen_sample", "topk", "softmax", "searchsorted", "cumsum")


def classify(name: str) -> str:
    if "batchgen_attention" in name or "attention" in name.lower():
        return "attention"
    if any(k in name for k in GEMM_NAMES):
        return "GEMM"
    if any(k in name for k in SAMPLING_NAMES):
        return "sampling"
    if any(k in name for k in ("batchgen_rmsnorm", "batchgen_rope", "batchgen_act")):  # batchgen's one-pass
        return "fused elementwise"  # RMSNorm, RoPE and SwiGLU activation: fused kernels of their own
    if "CompiledFxGraph" in name or "Torch-Compiled" in name or name.startswith(("cpp_fused", "graph_")):
        return "fused elementwise"
    return "other ops"


def shares(prof, wall_s: float) -> dict[str, float]:
    """Each class's share of the phase's wall time (the host's: what no op accounts for)."""
    got = dict.fromkeys(CLASSES, 0.0)
    for ev in prof.key_averages():
        if ev.key.startswith("ProfilerStep") or ev.key.startswith("##"):
            continue
        got[classify(ev.key)] += ev.self_cpu_time_total / 1e6
    op_s = sum(got.values())
    got["host"] = max(0.0, wall_s - op_s)
    total = sum(got.values()) or 1.0
    return {k: v / total for k, v in got.items()}


def top_ops(prof, steps: int, n: int) -> list[tuple[str, str, float, int]]:
    """The n ops with the most own time: (name, class, ms a step, calls a step)."""
    evs = [ev for ev in prof.key_averages() if not ev.key.startswith(("ProfilerStep", "##"))]
    evs.sort(key=lambda ev: -ev.self_cpu_time_total)
    s = max(steps, 1)
    return [(ev.key, classify(ev.key), ev.self_cpu_time_total / 1e3 / s, round(ev.count / s)) for ev in evs[:n]]


def profile_batch(model_dir, batch: int, decode_steps: int, compile_: str = "on", ops: int = 0,
                  dtype: str = "auto") -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from batchgen.benchmarks.bench import held_prompt_ids, run_engine
    from batchgen.config import EngineConfig, SamplingParams
    from batchgen.engine.native import NativeEngine

    cfg = EngineConfig(max_num_seqs=batch, max_model_len=2048, compile=compile_, enable_prefix_caching=False, dtype=dtype,
                       kv_cache_tokens=batch * 700 + 2048, max_num_batched_tokens=4096)
    e = NativeEngine(model_dir, cfg)
    ids = held_prompt_ids(e.tokenizer, batch)  # the bench's chat prompts
    # Prompts admitted early decode a token in each prefill step after theirs (chunked prefill, their
    # decodes taking part of each step's token budget), so every request runs long enough to be still
    # running through the profiled decode steps: all `batch` rows.
    per_step = max(cfg.max_num_batched_tokens - batch, cfg.max_num_batched_tokens // 2)
    prefill_steps = -(-sum(len(p) for p in ids) // per_step) + 1
    params = SamplingParams(max_tokens=prefill_steps + decode_steps + 2, ignore_eos=True)
    # warm-up, the same requests as the profiled ones: every bucket those steps use compiles here
    run_engine(e, ids, batch, params, None, "warm")
    for i, p in enumerate(ids):
        e.add(f"p-{i}", p, params)
    phases = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the prefill steps: until every prompt is in
        t0, steps, tokens = time.perf_counter(), 0, 0
        while e.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running):
            r = e.step()
            steps, tokens = steps + 1, tokens + r.num_prefill_tokens
        wall = time.perf_counter() - t0
    phases["prefill"] = {"steps": steps, "tokens": tokens, "wall_s": wall, "shares": shares(prof, wall),
                         "ops": top_ops(prof, steps, ops)}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0, steps, tokens = time.perf_counter(), 0, 0
        while e.has_unfinished() and steps < decode_steps:
            r = e.step()
            steps, tokens = steps + 1, tokens + r.num_decode_tokens
        wall = time.perf_counter() - t0
    phases["decode"] = {"steps": steps, "tokens": tokens, "wall_s": wall, "shares": shares(prof, wall),
                        "ops": top_ops(prof, steps, ops)}
    while e.has_unfinished():
        e.step()
    c = e.conditions()
    return {"batch": batch, "dtype": c["dtype"], "attention": c["attention_backend"], "compile": c["compile"],
            "threads": torch.get_num_threads(), "phases": phases}


def format_rows(rows: list[dict]) -> str:
    head = f"{'batch':>5} {'phase':<8} {'dtype':<9} {'ms/step':>8} {'tok/step':>8} " + " ".join(f"{c:>12}" for c in
                                                                            ("GEMM", "attention", "sampling", "fused ew",
                                                                             "other ops", "host"))
    lines = [head]
    for r in rows:
        for phase, p in r["phases"].items():
            ms = 1e3 * p["wall_s"] / max(p["steps"], 1)
            lines.append(f"{r['batch']:>5} {phase:<8} {r['dtype']:<9} {ms:>8.1f} {p['tokens'] / max(p['steps'], 1):>8.0f} "
                         + " ".join(f"{100 * p['shares'][c]:>11.0f}%" for c in CLASSES))
    for r in rows:
        for phase, p in r["phases"].items():
            if p.get("ops"):
                lines.append(f"batch {r['batch']} {phase}: the ops with the most own time (ms a step, calls a step)")
                lines += [f"  {ms:9.1f} {calls:6d}  {cls:<17} {name}" for name, cls, ms, calls in p["ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from batchgen.config import cap_cpu_libraries
    from batchgen.metrics.conditions import cpu_features, cpu_model
    from batchgen.model.prepare import resolve_model

    cap_cpu_libraries()  # as the CLI does: ATEN_CPU_CAPABILITY's cap for oneDNN and MKL too

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--ops", type=int, default=0, help="also list each phase's N ops with the most own time")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (auto: what a user gets by default)")
    a = p.parse_args(argv)
    model = resolve_model(a.model)
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        rows.append(profile_batch(model, b, decode_steps=a.decode_steps, ops=a.ops, dtype=a.dtype))
        print(f"  batch {b} done", flush=True)
    print(f"step profile, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()} ({cpu_features()}), "
          f"{rows[0]['threads']} torch threads; native engine, dtype {a.dtype}, compile on, attention "
          f"{rows[0]['attention']}; prefill: every held prompt's steps, decode: {a.decode_steps} steps; "
          f"one run, shares of each phase's wall time under the profiler")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
