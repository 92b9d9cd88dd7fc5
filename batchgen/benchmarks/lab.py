"""The cache lab: positions computed with a KV cache (P + N - 1) against recomputing the whole
history every step (N*P + N(N-1)/2), counted by the engine and timed on the real model."""

from __future__ import annotations

import time
from dataclasses import dataclass

from batchgen.config import EngineConfig, SamplingParams

LAB_TEXT = ("The history of the city begins with a small settlement on the river, where traders met to "
            "exchange grain, salt and cloth. Over the centuries it grew into a busy port. ")


@dataclass
class LabResult:
    mode: str
    positions_expected: int
    positions_counted: int
    seconds: float
    tokens: list[int]


def expected_positions(prompt_tokens: int, new_tokens: int, cache: bool) -> int:
    p, n = prompt_tokens, new_tokens
    return p + n - 1 if cache else n * p + n * (n - 1) // 2


def run_decode_lab(model_dir, prompt_tokens: int, new_tokens: int, device: str = "cpu") -> list[LabResult]:
    from batchgen.engine.native import NativeEngine

    results = []
    for cache in (True, False):
        cfg = EngineConfig(max_num_seqs=1, max_model_len=prompt_tokens + new_tokens + 1, enable_kv_cache=cache,
                           device=device)
        engine = NativeEngine(model_dir, cfg)
        ids = engine.tokenizer.encode(LAB_TEXT * (prompt_tokens // 8 + 1))[:prompt_tokens]
        engine.add("lab", ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        out: list[int] = []
        while engine.has_unfinished():
            for f in engine.step().finished:
                out = f.output_token_ids
        seconds = time.perf_counter() - t0
        results.append(LabResult("kv-cache" if cache else "recompute", expected_positions(prompt_tokens, new_tokens, cache),
                                 engine.num_computed_positions, seconds, out))
    return results


def format_lab(results: list[LabResult], prompt_tokens: int, new_tokens: int) -> str:
    cache, full = results
    lines = [f"decode lab: prompt {prompt_tokens} tokens, {new_tokens} new tokens, batch 1, greedy",
             f"{'mode':<10} {'positions (formula)':>20} {'positions (counted)':>20} {'seconds':>9}"]
    for r in results:
        lines.append(f"{r.mode:<10} {r.positions_expected:>20} {r.positions_counted:>20} {r.seconds:>9.2f}")
    lines.append(f"recompute / cache: {full.positions_counted / cache.positions_counted:.1f}x positions, "
                 f"{full.seconds / cache.seconds:.1f}x seconds; same tokens: {cache.tokens == full.tokens}")
    return "\n".join(lines)
