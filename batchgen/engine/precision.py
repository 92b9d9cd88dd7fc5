"""`--dtype auto`: the weight dtype that is fastest on this machine for the batch the engine packs.

CPUs differ in what their matmul units do with each dtype (a Zen 4 with AVX512_BF16 runs bf16 at
batch 64 about 2x fp32, but fp16 only fast at batch 1; a CPU without bf16 units emulates it), and
the answer changes with the batch size. So the crossover is measured, not assumed: once per machine,
a decode step's worth of matmuls (each in its fastest layout, batchgen.model.linear) is timed for
every dtype at batch bands 1, 8, 64 and 256, and cached beside the hardware probe. float32 is timed
on the kernel the engine will run it on (batchgen's gemv where it builds, or oneDNN's: a record for
each), so the choice compares what will actually run. The engine then takes, for the band nearest
its max_num_seqs, the fastest dtype. On CUDA, bf16 (fp16 where the GPU
has no bf16) without measuring: tensor cores run both at the same rate.
"""

from __future__ import annotations

import math
import time

import torch

from batchgen.model.linear import Linear, fp32_kernel

BANDS = (1, 8, 64, 256)
CANDIDATES = ("float32", "bfloat16", "float16")
# ~200 MB at fp32 (100 MB at 16 bits): past any CPU's caches, so batch 1 is bandwidth-bound as in decode
_SHAPES = ((3072, 1024), (1024, 3072), (4096, 1024), (1024, 1024)) * 5


def measure_dtype_speeds(device: str = "cpu", repeats: int = 2, fp32_width: int | None = None) -> dict:
    """Seconds per pass over _SHAPES' matrices, per band and dtype: {"speeds": {band: {dtype: s}}}.
    `fp32_width`: float32 on the gemv kernel with that block width (None: oneDNN's)."""
    torch.manual_seed(0)
    speeds: dict[str, dict[str, float]] = {}
    for name in CANDIDATES:
        dt = getattr(torch, name)
        mats = [Linear((torch.randn(n, k) * 0.02).to(dt), gemv_width=fp32_width) for n, k in _SHAPES]
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


def record_name(device: str, fp32: str = "auto") -> tuple[str, int | None]:
    """(the machine record's name, the gemv block width or None) for float32 on kernel choice `fp32`:
    a crossover measured against oneDNN's fp32 says nothing about gemv's, and the other way round."""
    width, _ = fp32_kernel(fp32, device)
    return ("-dtype" if width is None else f"-dtype-gemv{width}"), width


def resolve_dtype(requested: str, device: str, batch: int, fp32: str = "auto") -> tuple[str, str]:
    """(dtype, why). An explicit dtype is taken as asked. `fp32`: float32's kernel choice
    (batchgen.config.FP32_KERNELS), which the crossover is measured against."""
    if requested != "auto":
        return requested, "as requested"
    if device.startswith("cuda"):
        dt = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return dt, f"auto on CUDA: {dt}"
    from batchgen.metrics.probe import cached_measurement

    name, width = record_name(device, fp32)
    m = cached_measurement(name, device, lambda dev: measure_dtype_speeds(dev, fp32_width=width), prefix="dtype")
    band = band_of(batch)
    speeds = m["speeds"][str(band)]
    best = min(speeds, key=speeds.get)
    figures = ", ".join(f"{d} {1000 * s:.1f} ms" for d, s in speeds.items())
    return best, (f"auto: fastest at batch band {band} (max_num_seqs {batch}) on this CPU: {figures} per "
                  f"{m['bytes_fp32'] >> 20} MiB-fp32 pass, float32 on {'gemv' if width else 'oneDNN'} "
                  f"({m['dtype_source']})")
