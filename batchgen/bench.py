"""Side-by-side throughput of engines on one workload, in one process run, with its conditions.

    batchgen bench --engines native,vllm,hf --num-prompts 64 --new-tokens 64 --max-num-seqs 64

Every figure is measured in this run and printed as a ratio to the first engine listed. Start-up
(model load, vLLM's engine core) is excluded; prefill is included. Machines are shared and noisy:
compare ratios from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from batchgen.config import EngineConfig, SamplingParams

WORKLOAD = "Write a short story about a cat number {i}."


@dataclass
class BenchResult:
    engine: str
    output_tokens: int
    seconds: float
    startup_s: float

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(WORKLOAD.format(i=i)) for i in range(n)]


def bench_engine(name: str, model_dir, n: int, new_tokens: int, max_num_seqs: int, dtype: str) -> BenchResult:
    from batchgen.engine import create_engine

    t0 = time.perf_counter()
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256 + new_tokens, dtype=dtype,
                       max_num_batched_tokens=max(4096, 64 * max_num_seqs))
    engine = create_engine(name, model_dir, cfg)
    startup = time.perf_counter() - t0
    prompts = _prompts(engine.tokenizer, n)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add("warm-up", prompts[0], warm)
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(str(i), p, params)
    tokens = 0
    while engine.has_unfinished():
        tokens += len(engine.step().token_request_ids)
    seconds = time.perf_counter() - t0
    engine.close()
    return BenchResult(name, tokens, seconds, startup)


def bench_hf(model_dir, n: int, new_tokens: int, batch: int, dtype: str) -> BenchResult:
    """Hugging Face transformers `generate`, left-padded batches: the reference peer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    startup = time.perf_counter() - t0
    texts = [WORKLOAD.format(i=i) for i in range(n)]
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, n, batch):
            enc = tok(texts[s:s + batch], return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return BenchResult("hf", tokens, time.perf_counter() - t0, startup)


def run_bench(engines: list[str], model_dir, n: int, new_tokens: int, max_num_seqs: int,
              dtype: str = "float32") -> list[BenchResult]:
    results = []
    for name in engines:
        if name == "hf":
            results.append(bench_hf(model_dir, n, new_tokens, max_num_seqs, dtype))
        else:
            results.append(bench_engine(name, model_dir, n, new_tokens, max_num_seqs, dtype))
    return results


def format_bench(results: list[BenchResult], n: int, new_tokens: int, max_num_seqs: int, dtype: str, model) -> str:
    import torch

    from batchgen.metrics.conditions import cpu_model, package_versions

    base = results[0]
    lines = [f"workload: {n} prompts '{WORKLOAD}' -> {new_tokens} new tokens each (ignore_eos), greedy",
             f"conditions: model {model}, {dtype}, max_num_seqs/batch {max_num_seqs}, {cpu_model()}, "
             f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {package_versions()}",
             f"{'engine':<8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs ' + base.engine:>10} {'start-up s':>11}"]
    for r in results:
        lines.append(f"{r.engine:<8} {r.output_tokens:>7} {r.seconds:>8.2f} {r.tok_per_s:>8.1f} "
                     f"{r.tok_per_s / base.tok_per_s:>9.2f}x {r.startup_s:>11.1f}")
    return "\n".join(lines)
