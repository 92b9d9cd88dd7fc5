"""`--dtype auto`: the weight dtype that is fastest on this machine for the batch the engine packs.

CPUs differ in what their matmul units do with each dtype (a Zen 4 with AVX512_BF16 runs bf16 at
batch 64 about 2x fp32, but fp16 only fast at batch 1; a CPU without bf16 units emulates it), and
the answer changes with the batch size. So the crossover is measured, not assumed: once per machine,
a decode step's worth of matmuls (each in its fastest layout, batchgen.model.linear) is timed for
every dtype at batch bands 1, 8, 64 and 256, and cached beside the hardware probe. float32 is timed
on the kernel the engine will run it on (batchgen's gemv where it builds, or oneDNN's: a record for
each), so the choice compares what will actually run. Which of those two kernels float32 runs on is
itself chosen per band the same way (resolve_fp32_kernel), first. batchgen.engine.resolve.plan_engine
then takes the fastest dtype for one band: INVARIANT_BATCH's in a batch-invariant run, else the band
nearest max_num_seqs. On CUDA, bf16 (fp16 where the GPU
has no bf16) without measuring: tensor cores run both at the same rate.
"""

from __future__ import annotations

import hashlib
import math
import time

import torch

from batchgen import kernels
from batchgen.config import ModelConfig
from batchgen.model.linear import Linear, fp32_kernel

BANDS = (1, 8, 64, 256)
# A batch-invariant run chooses its weights by the machine alone, never by its max_num_seqs: at the band
# of this batch (the default max_num_seqs'), and only among kernels that sum each row in one fixed order
# whatever the rows beside it: float32 on batchgen's gemv, bfloat16 on its bgemm (resolve_invariant_dtype),
# the model's GGUF blocks on qgemv (resolve_gguf). oneDNN's GEMMs pick their blocking by the number of
# rows and threads, so their row sums move with the batch (docs/reproducible.md).
INVARIANT_BATCH = 32
CANDIDATES = ("float32", "bfloat16", "float16")
# ~200 MB at fp32 (100 MB at 16 bits): past any CPU's caches, so batch 1 is bandwidth-bound as in decode
_SHAPES = ((3072, 1024), (1024, 3072), (4096, 1024), (1024, 1024)) * 5
MEASURE_CAP_BYTES = 256 << 20  # a model's fp32 kernel crossover is timed on at most this much of its matrices


def _fastest_passes(variants: dict[str, list], dt: torch.dtype | dict[str, torch.dtype],
                    repeats: int) -> dict[str, dict[str, float]]:
    """{band: {variant: the fastest of `repeats` passes over its matrices, seconds}}. The variants take
    turns inside each repeat, so a slow patch of a shared machine falls on all of them. `dt`: the
    activations' dtype, or one per variant."""
    dts = dt if isinstance(dt, dict) else dict.fromkeys(variants, dt)
    speeds: dict[str, dict[str, float]] = {}
    ks = {m.in_features for mats in variants.values() for m in mats}
    for band in BANDS:
        x32 = {k: torch.randn(band, k) for k in ks}
        xs = {d: {k: x.to(d) for k, x in x32.items()} for d in set(dts.values())}
        best = dict.fromkeys(variants, math.inf)
        with torch.inference_mode():
            for name, mats in variants.items():
                for m in mats[:4]:  # warm each kernel up once
                    m(xs[dts[name]][m.in_features])
            for _ in range(repeats):
                for name, mats in variants.items():
                    x = xs[dts[name]]
                    t0 = time.perf_counter()
                    for m in mats:
                        m(x[m.in_features])
                    best[name] = min(best[name], time.perf_counter() - t0)
        speeds[str(band)] = best
    return speeds


def _weights(shapes=_SHAPES) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(n, k) * 0.02 for n, k in shapes]


def measure_dtype_speeds(device: str = "cpu", repeats: int = 2, fp32_width: int | None = None) -> dict:
    """Seconds per pass over _SHAPES' matrices, per band and dtype: {"speeds": {band: {dtype: s}}}.
    `fp32_width`: float32 on the gemv kernel with that block width (None: oneDNN's)."""
    speeds: dict[str, dict[str, float]] = {str(b): {} for b in BANDS}
    for name in CANDIDATES:  # one dtype's matrices at a time: all three would hold ~0.5 GB
        dt = getattr(torch, name)
        mats = [Linear(w.to(dt), gemv_width=fp32_width) for w in _weights()]
        for band, best in _fastest_passes({name: mats}, dt, repeats).items():
            speeds[band].update(best)
    return {"speeds": speeds, "bytes_fp32": sum(n * k * 4 for n, k in _SHAPES)}


def decode_matrices(c: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of the matrices a decode step of model `c` multiplies, scaled down to at most
    MEASURE_CAP_BYTES at float32: as many layers' four matrices as that share of the layers, and the
    LM head with its rows cut by the same share. The kernels' crossover moves with the shapes (K
    sets how much of a row of x stays in cache), so it is measured on the model's own."""
    layer = [((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
             (c.hidden_size, c.num_heads * c.head_dim),
             (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    head = (c.vocab_size, c.hidden_size)
    total = 4 * (c.num_layers * sum(n * k for n, k in layer) + head[0] * head[1])
    share = min(1.0, MEASURE_CAP_BYTES / total)
    return layer * max(1, round(c.num_layers * share)) + [(max(1, round(head[0] * share)), head[1])]


def measure_fp32_kernels(device: str, width: int, shapes: list[tuple[int, int]] | None = None,
                         repeats: int = 3) -> dict:
    """float32 on batchgen's gemv kernel (block width `width`) and on oneDNN's, per band, in turns, over
    matrices of `shapes` (default: _SHAPES): {"speeds": {band: {"gemv": s, "onednn": s}}}."""
    ws = _weights(shapes or _SHAPES)
    speeds = _fastest_passes({"gemv": [Linear(w, gemv_width=width) for w in ws], "onednn": [Linear(w) for w in ws]},
                             torch.float32, repeats)
    return {"speeds": speeds, "bytes_fp32": sum(w.numel() * 4 for w in ws), "matrices": len(ws)}


def fp32_kernel_record(width: int, shapes: list[tuple[int, int]] | None = None) -> str:
    """The machine record's name for a crossover on `shapes` (one per model shape)."""
    key = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12] if shapes else "generic"
    return f"-fp32-kernel-gemv{width}-{kernels.builds('gemv')}-{key}"


# oneDNN's kernel replaces gemv only where it is this much faster: near the crossover the two trade
# places from one measurement to the next, and a machine's cached choice should not be a coin toss
FP32_KERNEL_MARGIN = 1.05


def resolve_fp32_kernel(requested: str, device: str, batch: int,
                        shapes: list[tuple[int, int]] | None = None, invariant: bool = False) -> tuple[str, str]:
    """(gemv | onednn, why) for float32 weights. gemv streams the weights once for a few rows and wins
    at decode's small batches; oneDNN's blocked GEMM reuses each tile across many rows and wins as
    the batch grows. So `auto` takes, for the band nearest max_num_seqs, the
    faster of the two from a crossover measured once per machine and model shape (`shapes`, see
    decode_matrices; seconds) and cached. `invariant` (a batch-invariant run): gemv wherever it builds."""
    if requested != "auto":
        return requested, "as requested"
    width, why = fp32_kernel("auto", device)
    if width is None:
        return "onednn", f"gemv unavailable: {why}"
    if invariant:
        return "gemv", "batch-invariant: gemv, whose row sums do not depend on the batch"
    from batchgen.metrics.probe import cached_measurement

    m = cached_measurement(fp32_kernel_record(width, shapes), device,
                           lambda dev: measure_fp32_kernels(dev, width, shapes), prefix="fp32_kernel")
    band = band_of(batch)
    speeds = m["speeds"][str(band)]
    best = "onednn" if speeds["onednn"] * FP32_KERNEL_MARGIN < speeds["gemv"] else "gemv"
    return best, (f"auto: {best} at batch band {band} (max_num_seqs {batch}) on this CPU: gemv "
                  f"{1000 * speeds['gemv']:.1f} ms, oneDNN {1000 * speeds['onednn']:.1f} ms per "
                  f"{m['bytes_fp32'] >> 20} MiB pass over {'the model' if shapes else 'generic'} shapes; oneDNN's where {FP32_KERNEL_MARGIN - 1:.0%} faster "
                  f"({m['fp32_kernel_source']})")


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
    (batchgen.config.FP32_KERNELS), which the crossover is measured against. A batch-invariant run
    chooses with resolve_invariant_dtype instead."""
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


# ---- `--dtype auto` in a batch-invariant run: among the kernels whose rows do not depend on the batch --

def measure_invariant(device: str, shapes: list[tuple[int, int]], fp32_width: int, repeats: int = 3) -> dict:
    """float32 on gemv against bfloat16 on bgemm, per band, in turns, over matrices of `shapes` (the
    model's, decode_matrices): {"speeds": {band: {"float32": s, "bfloat16": s}}}."""
    ws = _weights(shapes)
    speeds = _fastest_passes({"float32": [Linear(w, gemv_width=fp32_width) for w in ws],
                              "bfloat16": [Linear(w.bfloat16(), bf16_tiles=True) for w in ws]},
                             {"float32": torch.float32, "bfloat16": torch.bfloat16}, repeats)
    return {"speeds": speeds, "matrices": len(ws)}


def resolve_invariant_dtype(device: str, shapes: list[tuple[int, int]], fp32_width: int | None,
                            bf16_isa: str | None) -> tuple[str, str] | None:
    """(dtype, why) for `--dtype auto` with batch invariance on, on CPU: the faster of float32 on gemv
    (`fp32_width`: where it builds) and bfloat16 on bgemm (`bf16_isa`: the instructions it runs on,
    where it builds), at the band of INVARIANT_BATCH, measured once per machine and model shape and
    cached; by the machine alone, never by max_num_seqs. None where neither kernel builds here."""
    if fp32_width is None and bf16_isa is None:
        return None
    if bf16_isa is None or fp32_width is None:
        only = "float32 on gemv" if bf16_isa is None else f"bfloat16 on bgemm ({bf16_isa})"
        return only.split()[0], f"auto, batch-invariant: {only}, the one batch-invariant kernel that builds here"
    from batchgen.metrics.probe import cached_measurement

    key = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    m = cached_measurement(f"-invariant-gemv{fp32_width}-bgemm-{bf16_isa}-{kernels.builds('gemv', 'bgemm')}-{key}",
                           device,
                           lambda dev: measure_invariant(dev, shapes, fp32_width), prefix="invariant")
    band = band_of(INVARIANT_BATCH)
    speeds = m["speeds"][str(band)]
    best = min(speeds, key=speeds.get)
    return best, (f"auto, batch-invariant: fastest at batch band {band} on this CPU (by the machine, not "
                  f"max_num_seqs): float32 on gemv {1000 * speeds['float32']:.1f} ms, bfloat16 on bgemm ({bf16_isa}) "
                  f"{1000 * speeds['bfloat16']:.1f} ms per pass over the model's shapes ({m['invariant_source']})")


# ---- the model's own GGUF blocks as a candidate of `--dtype auto` ----------------------------------

def measure_gguf(device: str, shapes: list[tuple[int, int]], dtype: str, fp32_width: int | None,
                 repeats: int = 3, bf16_tiles: bool = False) -> dict:
    """Q4_1 blocks on batchgen's qgemv kernel (float32 activations) against `dtype` on its own kernel,
    per band, in turns, over matrices of `shapes` (the model's, decode_matrices): {"speeds": {band:
    {"gguf": s, dtype: s}}}. The blocks' values do not matter to the time: random codes."""
    from batchgen.model.ggml import QK, BlockLinear

    gen = torch.Generator().manual_seed(0)
    blocks = [BlockLinear("Q4_1", torch.randint(0, 256, (n, k // QK, 16), dtype=torch.uint8, generator=gen),
                          torch.full((n, k // QK), 0.01, dtype=torch.float16),
                          torch.full((n, k // QK), -0.08, dtype=torch.float16)) for n, k in shapes]
    dt = getattr(torch, dtype)
    dense = [Linear(w.to(dt), gemv_width=fp32_width if dtype == "float32" else None, bf16_tiles=bf16_tiles)
             for w in _weights(shapes)]
    speeds = _fastest_passes({"gguf": blocks, dtype: dense}, {"gguf": torch.float32, dtype: dt}, repeats)
    return {"speeds": speeds, "matrices": len(shapes)}


def resolve_gguf(model_dir, c: ModelConfig, dtype: str, fp32_width: int | None, batch: int,
                 bf16_tiles: bool = False) -> tuple[bool, str]:
    """(run the model's GGUF blocks?, why) for `--dtype auto` on CPU, against `dtype`, what auto took
    among the dense dtypes. The blocks are taken where the model ships them (SmolLM2's Q4_1 layers
    and Q8_0 head: the model's exact weights, so nothing is lost; float32 activations), batchgen's
    qgemv kernel builds here, and they measure faster at the batch band nearest max_num_seqs (once
    per machine, model shape and dense dtype; cached). At decode's few rows they read 0.625 bytes a
    weight instead of 2 or 4; at wide batches the dense GEMMs win."""
    from batchgen.metrics.probe import cached_measurement
    from batchgen.model import ggml

    try:
        ggml.find_gguf(model_dir)
    except ggml.GGUFError:
        return False, "the model directory holds no GGUF file"
    isa = ggml.load()
    if isinstance(isa, str):
        return False, f"the GGUF kernel cannot run here ({isa})"
    shapes = [(n, k) for n, k in decode_matrices(c) if k % ggml.QK == 0]
    key = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    tiles = "-bgemm" if bf16_tiles and dtype == "bfloat16" else ""
    m = cached_measurement(f"-gguf-{dtype}{tiles}-gemv{fp32_width or 0}-{kernels.builds('qgemv', 'gemv', 'bgemm')}-{key}",
                           "cpu",
                           lambda dev: measure_gguf(dev, shapes, dtype, fp32_width, bf16_tiles=bool(tiles)),
                           prefix="gguf")
    band = band_of(batch)
    speeds = m["speeds"][str(band)]
    take = speeds["gguf"] < speeds[dtype]
    return take, (f"at batch band {band}: the model's GGUF blocks {1000 * speeds['gguf']:.1f} ms, {dtype} "
                  f"{1000 * speeds[dtype]:.1f} ms per pass over the model's shapes ({m['gguf_source']})")