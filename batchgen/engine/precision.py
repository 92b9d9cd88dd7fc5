"""`--dtype auto`: the weight dtype that is fastest on this machine for the batch the engine packs.

CPUs differ in what their matmul units do with each dtype (a Zen 4 with AVX512_BF16 runs bf16 at
batch 64 about 2x fp32, but fp16 only fast at batch 1; a CPU without bf16 units emulates it), and
the answer changes with the batch size. So the crossover is measured, not assumed: once per machine,
a decode step's worth of matmuls (each in its fastest layout, batchgen.model.linear) is timed for
every dtype at batch bands 1, 8, 64 and 256, and cached beside the hardware probe. The engine then
takes, for the band nearest its max_num_seqs, the fastest dtype. On CUDA, bf16 (fp16 where the GPU
has no bf16) without measuring: tensor cores run both at the same rate.
"""

from __future__ import annotations

import math
import time

import torch

from batchgen.model.linear import Linear

BANDS = (1, 8, 64, 256)
CANDIDATES = ("float32", "bfloat16", "float16")
# ~200 MB at fp32 (100 MB at 16 bits): past any CPU's caches, so batch 1 is bandwidth-bound as in decode
_SHAPES = ((3072, 1024), (1024, 3072), (4096, 1024), (1024, 1024)) * 5


def measure_dtype_speeds(device: str = "cpu", repeats: int = 2) -> dict:
    """Seconds per pass over _SHAPES' matrices, per band and dtype: {"speeds": {band: {dtype: s}}}."""
    torch.manual_seed(0)
    speeds: dict[str, dict[str, float]] = {}
    for name in CANDIDATES:
        dt = getattr(torch, name)
        mats = [Linear((torch.randn(n, k) * 0.02).to(dt)) for n, k in _SHAPES]
        for band in BANDS:
            xs = {k: torch.randn(band, k).to(dt) for k in {m.in_features for m in mats}}
            best = math.inf
            with torch.inference_mode():
                for m in mats[:4]:  # warm each kernel up once
                    m(xs[m.in_features])
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for m in mats:
                        m(xs[m.in_features])
                    best = min(best, time.perf_counter() - t0)
            speeds.setdefault(str(band), {})[name] = best
    return {"speeds": speeds, "bytes_fp32": sum(n * k * 4 for n, k in _SHAPES)}


def band_of(batch: int) -> int:
    """The measured band nearest `batch` on a log scale."""
    return min(BANDS, key=lambda b: abs(math.log(max(batch, 1) / b)))


def resolve_dtype(requested: str, device: str, batch: int) -> tuple[str, str]:
    """(dtype, why). An explicit dtype is taken as asked."""
    if requested != "auto":
        return requested, "as requested"
    if device.startswith("cuda"):
        dt = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return dt, f"auto on CUDA: {dt}"
    from batchgen.metrics.probe import cached_measurement

    m = cached_measurement("-dtype", device, measure_dtype_speeds, prefix="dtype")
    band = band_of(batch)
    speeds = m["speeds"][str(band)]
    best = min(speeds, key=speeds.get)
    figures = ", ".join(f"{d} {1000 * s:.1f} ms" for d, s in speeds.items())
    return best, (f"auto: fastest at batch band {band} (max_num_seqs {batch}) on this CPU: {figures} per "
                  f"{m['bytes_fp32'] >> 20} MiB-fp32 pass ({m['dtype_source']})")
