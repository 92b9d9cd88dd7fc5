"""Measured peak read bandwidth and matmul FLOP/s (float32 and bfloat16) of the device, for MBU/MFU
(a second or two).

The result is cached per machine (CPU model and flags, cores, GPU, torch version) under
BATCHGEN_HOME/probe/, so a run's start-up does not pay for it again; the conditions say when and
where the figures were measured. BATCHGEN_REPROBE=1 measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from batchgen.config import batchgen_home

PROBE_VERSION = 1  # bump when the measurement changes, so old cached figures are not reused


def _best_seconds(fn, device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn (after one untimed)."""
    import torch

    dev = torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def peak_read(device: str = "cpu", mib: int = 256, repeats: int = 3) -> float:
    """Read bandwidth in bytes/s: the best of `repeats` STREAM-like passes summing a `mib` MiB buffer
    (a fraction of a second); a bench measures it again beside each repeat, as a shared machine drifts."""
    import torch

    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=torch.device(device))
    return x.numel() * 4 / _best_seconds(lambda: x.sum(), device, repeats)


CRAWL_S = 0.25  # a first matmul on CRAWL_ROWS rows slower than this: the dtype has no vector path here
CRAWL_ROWS = 16


def matmul_flops(a, b, device: str, repeats: int, crawl_s: float = CRAWL_S) -> tuple[float, int]:
    """(FLOP/s of a @ b, the best of `repeats` calls; the rows it was measured on). A product on
    CRAWL_ROWS of a's rows comes first (timed after an untimed one, so a library's first-call set-up,
    cuBLAS's for one, is not taken for a crawl): where it takes more than `crawl_s` (bf16 on a CPU
    without bf16 math runs well under 1 GFLOP/s, and the full product would take a minute), its rate
    is the figure, on those rows."""
    rows = a[:CRAWL_ROWS]
    first_s = _best_seconds(lambda: rows @ b, device, 1)
    if first_s > crawl_s:
        return 2 * rows.shape[0] * b.shape[0] * b.shape[1] / first_s, rows.shape[0]
    return 2 * a.shape[0] * b.shape[0] * b.shape[1] / _best_seconds(lambda: a @ b, device, repeats), a.shape[0]


def peak_matmul(device: str = "cpu", dtype: str = "float32", repeats: int = 3) -> tuple[float, int]:
    """(FLOP/s, rows) of a [512, 2048] x [2048, 2048] product in `dtype` on a CPU ([8192, 8192]
    squared on a GPU): the matmul peak MFU is against. bf16's is its own (AMX or AVX512_BF16 where the
    CPU has them; a crawl on AVX2, measured on fewer rows). A bench measures it again beside each
    repeat of a cell whose prefill it judges, as it does the read peak."""
    import torch

    dev = torch.device(device)
    n = 2048 if dev.type == "cpu" else 8192
    a = torch.randn(512 if dev.type == "cpu" else n, n, device=dev).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    return matmul_flops(a, b, device, repeats)


def probe_device(device: str = "cpu", mib: int = 256, repeats: int = 3) -> dict[str, float]:
    read = peak_read(device, mib, repeats)
    fp32, fp32_rows = peak_matmul(device, "float32", repeats)
    bf16, bf16_rows = peak_matmul(device, "bfloat16", repeats)
    return {"peak_read_bytes_per_s": read, "peak_flops_fp32": fp32, "peak_flops_bfloat16": bf16,
            "probe_matmul_rows_fp32": fp32_rows, "probe_matmul_rows_bfloat16": bf16_rows, "probe_buffer_mib": mib}


def machine_key(device: str) -> str:
    """What makes two probes comparable: the same CPU (model, flags, cores), GPU and torch."""
    import torch

    from batchgen.metrics.conditions import cpu_model

    flags = ""
    try:
        flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    raw = f"{PROBE_VERSION}|{cpu_model()}|{flags}|{os.cpu_count()}|{torch.get_num_threads()}|{device}|{gpu}|{torch.__version__}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def cached_probe(device: str = "cpu", cache_dir: Path | None = None) -> dict[str, float | str]:
    """probe_device's figures for this machine: measured once, then read from the cache."""
    return cached_measurement("", device, probe_device, cache_dir, prefix="probe")


def machine_record(name: str, device: str, cache_dir: Path | None = None) -> Path:
    """Where a figure measured on this machine is kept: BATCHGEN_HOME/probe/<machine key><name>.json."""
    home = batchgen_home()
    return (cache_dir or home / "probe") / f"{machine_key(device)}{name}.json"


def write_record(path: Path, figures: dict) -> None:
    """Write a record atomically (readers never see half a file); a read-only home keeps nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, path)
    except OSError:
        pass


def cached_measurement(name: str, device: str, measure, cache_dir: Path | None = None,
                       prefix: str = "probe") -> dict:
    """`measure(device)`'s JSON-able dict for this machine: measured once, then read from its
    `machine_record` (BATCHGEN_REPROBE=1 measures again)."""
    path = machine_record(name, device, cache_dir)
    if path.is_file() and not os.environ.get("BATCHGEN_REPROBE"):
        try:
            return {**json.loads(path.read_text()), f"{prefix}_source": f"cached ({path})"}
        except (OSError, ValueError):
            pass  # unreadable: measure again
    figures = {**measure(device), f"{prefix}_measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_record(path, figures)  # a read-only home: measured every time
    return {**figures, f"{prefix}_source": "measured in this run"}
