"""The paged-attention op alone, as the engine calls it: batchgen's C++ kernel against the PyTorch path
it replaces (`_tile_attention`, the gathered blocks and a dozen ops), both measured in this run, on a
model's attention shapes and the bench's context lengths.

    python -m batchgen.benchmarks.attention_op --dtype bfloat16 --batch 64
    python -m batchgen.benchmarks.attention_op --dtype float32 --layers 30 --repeats 7

Two cases: a decode step (`--batch` rows, contexts drawn from 150 to 560 positions: the bench's
100-500-token prompts plus up to 64 new tokens) and a prefill step (prompts of 146-498 tokens until
`--prefill-tokens`, in the engine's 64-token tiles). Each of `--layers` layers has a cache of its own,
so the decode case reads its KV from memory as a real step does; each time is the fastest of
`--repeats`. Prints the ms a step (all layers), the op's GFLOP/s and KV GB/s, the kernel's speed-up
over the PyTorch path, and the run's conditions. KV GB/s counts each sequence's keys and values once:
what a decode step reads, but a floor for a prefill step, whose 64-token tiles each read their
prompt's earlier blocks again.
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace


def _plan(lengths: list[int], width: int, keys: int, bs: int, decode: bool):
    """The engine's tile plan (model_runner._TileBuilder) over consecutive block tables; the blocks needed."""
    import torch

    from batchgen.engine.model_runner import _TileBuilder

    b, base, nxt = _TileBuilder(width), 0, 0
    for n in lengths:
        nb = (n - 1) // bs + 1
        table = list(range(nxt, nxt + nb))
        nxt += nb
        if decode:  # the newest token of an n-position context
            b.add(SimpleNamespace(start=n - 1, num_tokens=1), base, table, bs, max(1, keys // bs))
            base += 1
        else:
            b.add(SimpleNamespace(start=0, num_tokens=n), base, table, bs, max(1, keys // bs))
            base += n
    return b.group({"dtype": torch.long, "device": "cpu"}), base, nxt


def measure(case: str, dtype, batch: int, prefill_tokens: int, layers: int, repeats: int, seed: int = 0) -> dict:
    import torch

    from batchgen.engine.attention import _tile_attention
    from batchgen.engine.attention_metadata import DECODE_KEYS, PREFILL_KEYS, PREFILL_TILE

    hkv, groups, dims, bs = 3, 3, 64, 16  # SmolLM2-135M: 9 query heads over 3 KV heads of 64 dims
    rng = random.Random(seed)
    if case == "decode":
        lengths = [rng.randint(150, 560) for _ in range(batch)]
        g, tokens, blocks = _plan(lengths, 1, DECODE_KEYS, bs, decode=True)
        pairs = sum(lengths)  # query-key pairs a query head scores
    else:
        lengths = []
        while sum(lengths) < prefill_tokens:
            lengths.append(min(rng.randint(146, 498), prefill_tokens - sum(lengths)))
        g, tokens, blocks = _plan(lengths, PREFILL_TILE, PREFILL_KEYS, bs, decode=False)
        pairs = sum(n * (n + 1) // 2 for n in lengths)
    gen = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(blocks, hkv, bs, dims, generator=gen).to(dtype),
               torch.randn(blocks, hkv, bs, dims, generator=gen).to(dtype)) for _ in range(layers)]
    q = torch.randn(tokens, hkv, groups, dims, generator=gen).to(dtype)[g.token_idx]
    scale = dims ** -0.5
    op = torch.ops.batchgen_attention.paged

    def kernel(k, v):
        return op(q, k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, scale, 0, 0.0)

    def torch_path(k, v):
        return _tile_attention(q, g, k, v, scale)

    out = {}
    for name, fn in (("kernel", kernel), ("torch", torch_path)):
        fn(*caches[0])  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for k, v in caches:
                fn(k, v)
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    flops = 4 * pairs * hkv * groups * dims * layers  # scores and weighted values, 2 FLOPs a multiply-add
    kv_bytes = 2 * sum(lengths) * hkv * dims * caches[0][0].element_size() * layers
    return {"case": case, "rows": len(lengths), "tokens": sum(lengths) if case == "prefill" else len(lengths),
            "mean_context": sum(lengths) / len(lengths), "flops": flops, "kv_bytes": kv_bytes, **out}


def main(argv: list[str] | None = None) -> int:
    import torch

    from batchgen import kernels
    from batchgen.config import cap_cpu_libraries
    from batchgen.metrics.conditions import cpu_features, cpu_model

    cap_cpu_libraries()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    why = kernels.load("attention")
    if why is not None:
        print(f"batchgen's attention kernel is unavailable here: {why}")
        return 1
    dtype = getattr(torch, a.dtype)
    print(f"paged attention op, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()} ({cpu_features()}), "
          f"{torch.get_num_threads()} torch threads; {a.dtype}, 3 KV heads x 3 query heads x 64 dims, blocks of 16, "
          f"{a.layers} layers (a cache each), fastest of {a.repeats}")
    print(f"{'case':<8} {'rows':>5} {'tokens':>7} {'mean ctx':>9} {'kernel ms':>10} {'GFLOP/s':>8} {'KV GB/s':>8} "
          f"{'torch ms':>9} {'kernel / torch':>15}")
    for case in ("decode", "prefill"):
        m = measure(case, dtype, a.batch, a.prefill_tokens, a.layers, a.repeats)
        print(f"{case:<8} {m['rows']:>5} {m['tokens']:>7} {m['mean_context']:>9.0f} {1e3 * m['kernel']:>10.1f} "
              f"{m['flops'] / m['kernel'] / 1e9:>8.1f} {m['kv_bytes'] / m['kernel'] / 1e9:>8.1f} "
              f"{1e3 * m['torch']:>9.1f} {m['torch'] / m['kernel']:>14.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
