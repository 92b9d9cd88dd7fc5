"""The GPU check: a random-init model of Llama-3-8B shape on the device, decoded by the native engine
at batch 1, 64 and 256; tok/s, ITL p50/p99 and MBU, with the run's conditions.

    python -m batchgen.benchmarks.gpu     # CUDA when there is one (Llama-3-8B shape, 8 minutes at most
                                          # on one H100/H200), else the small shape on CPU
    python -m batchgen.benchmarks.gpu --shape llama3-8b --device cuda --batches 1,64,256

Prompts are random token ids (the weights know no language), the same for every batch size; every
request generates --new-tokens tokens (ignore_eos). The KV pool holds every request (no preemption).
MBU = bytes the steps read (weights + KV, docs/METRICS.md) per second over the probe's peak read
bandwidth for this device. Figures are one run: print them with their conditions.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def run(shape: str, device: str, batches: list[int], prompt_tokens: int, new_tokens: int, compile_: str,
        log=print, cuda_graphs: str = "auto") -> list[dict]:
    from batchgen.config import EngineConfig, SamplingParams
    from batchgen.engine.native import NativeEngine
    from batchgen.engine.precision import resolve_dtype
    from batchgen.metrics.probe import cached_probe
    from batchgen.model.random_init import SHAPES, IdTokenizer, random_model

    t0 = time.perf_counter()
    dtype, why = resolve_dtype("auto", device, max(batches))
    max_len = prompt_tokens + new_tokens + 16
    model = random_model(shape, getattr(torch, dtype), device, max_positions=max_len)
    build_s = time.perf_counter() - t0
    probe = cached_probe(device)
    peak = probe["peak_read_bytes_per_s"]
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "none"
    log(f"shape {shape} ({model.weight_bytes / 1e9:.2f} GB of weights, {dtype}: {why}), built on {device} in "
        f"{build_s:.1f} s; GPU {gpu}; torch {torch.__version__}; probe peak read {peak / 1e9:.0f} GB/s "
        f"({probe.get('probe_source')}); prompts {prompt_tokens} random tokens, {new_tokens} new tokens each")
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = torch.randint(1, vocab, (max(batches), prompt_tokens), generator=gen).tolist()
    rows = []
    for b in batches:
        cfg = EngineConfig(max_num_seqs=b, max_model_len=max_len, device=device, kv_cache_tokens=b * max_len,
                           max_num_batched_tokens=max(4096, 2 * prompt_tokens), compile=compile_,
                           enable_prefix_caching=False, cuda_graphs=cuda_graphs)
        engine = NativeEngine("<random>", cfg, model=model, tokenizer=IdTokenizer())
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        # an untimed pass of the same batch first: every (rows, pairs) bucket the timed pass meets is
        # captured (or compiled) there, not inside the timed steps
        warm_up_s = _decode(engine, prompts[:b], params, "warm-up")[3]
        gaps, tokens, nbytes, seconds = _decode(engine, prompts[:b], params, "timed")
        g = torch.tensor(gaps, dtype=torch.float64)
        c = engine.conditions()
        row = {"batch": b, "tok_per_s": tokens / seconds, "itl_p50_ms": 1000 * g.quantile(0.5).item(),
               "itl_p99_ms": 1000 * g.quantile(0.99).item(), "mbu": nbytes / seconds / peak, "seconds": seconds,
               "compile": c["compile"], "compile_s": c["compile_s"], "attention": c["attention_backend"],
               "kv_cache_gb": c["kv_cache_bytes"] / 1e9, "cuda_graphs": c["cuda_graphs"], "warm_up_s": warm_up_s}
        rows.append(row)
        log(f"batch {b:>4}: {row['tok_per_s']:9.1f} tok/s  ITL p50 {row['itl_p50_ms']:7.2f} ms  p99 "
            f"{row['itl_p99_ms']:7.2f} ms  MBU {row['mbu']:.2f}  ({seconds:.1f} s, after a {warm_up_s:.1f} s warm-up; "
            f"compile {row['compile']} "
            f"{row['compile_s'] or 0:.1f} s; attention {row['attention']}; KV {row['kv_cache_gb']:.2f} GB; "
            f"graphs: {row['cuda_graphs']})")
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def _decode(engine, prompts: list[list[int]], params, tag: str) -> tuple[list[float], int, int, float]:
    """Run every prompt to its end: (inter-token gaps in seconds, tokens, bytes read, seconds)."""
    for i, p in enumerate(prompts):
        engine.add(f"{tag}-{i}", p, params)
    last, gaps, tokens, nbytes = {}, [], 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        r = engine.step()
        tokens += len(r.token_request_ids)
        nbytes += r.bytes_read
        for rid in r.token_request_ids:
            if rid in last:
                gaps.append(r.end_t - last[rid])
            last[rid] = r.end_t
    return gaps, tokens, nbytes, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--shape", default="llama3-8b" if cuda else "small")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128 if cuda else 32)
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--cuda-graphs", default="auto" if cuda else "on", choices=["auto", "on", "off"],
                   help="the decode step captured per bucket (auto: on CUDA with the PyTorch paged attention; on "
                        "CPU, on runs the same static buckets, not captured)")
    a = p.parse_args(argv)
    print(f"batchgen GPU check, {time.strftime('%Y-%m-%d %H:%M:%S')}, host {os.uname().nodename}")
    if not a.device.startswith("cuda"):
        print("no CUDA device: the GPU check's code path on CPU (decode steps in static buckets, not captured; "
              "its figures are not a GPU's)")
    run(a.shape, a.device, [int(b) for b in a.batches.split(",")], a.prompt_tokens, a.new_tokens, a.compile,
        cuda_graphs=a.cuda_graphs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
