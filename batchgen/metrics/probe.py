"""Measured peak read bandwidth and matmul FLOP/s of the device, for MBU/MFU (a second or two)."""

from __future__ import annotations

import time


def probe_device(device: str = "cpu", mib: int = 256, repeats: int = 3) -> dict[str, float]:
    import torch

    dev = torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def best(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=dev)
    read_s = best(lambda: x.sum())  # STREAM-like: one pass reading every byte
    n = 2048 if dev.type == "cpu" else 8192
    a = torch.randn(512 if dev.type == "cpu" else n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    mm_s = best(lambda: a @ b)
    return {"peak_read_bytes_per_s": x.numel() * 4 / read_s, "peak_flops_fp32": 2 * a.shape[0] * n * n / mm_s,
            "probe_buffer_mib": mib}
