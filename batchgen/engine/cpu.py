"""CPU floating-point mode for the native engine.

Subnormal floats (below 1.2e-38 in fp32) take a slow microcode path on x86. Sampled text made them
common enough in the forward that a batch-8 fp32 step ran 12% slower sampled than greedy (40 against
45 ms, SmolLM2-135M, 2-core Zen 4); flushed to zero, 32 and 33 ms. A value that small is zero to a
logit.

`torch.set_flush_denormal` sets the flag (FTZ/DAZ in MXCSR) on the calling thread only, and the
OpenMP workers that run ATen's, oneDNN's and Inductor's parallel loops keep their own: measured, a
multiply over 20M subnormals flushed exactly the main thread's half. So the flag is set once inside
an OpenMP parallel region of the runtime PyTorch loaded, on every thread of its pool. Threads
created later inherit it from the thread that creates them.
"""

from __future__ import annotations

import ctypes
import os

import torch

_done: bool | None = None


def flush_denormals() -> bool:
    """Flush subnormal floats to zero on this thread and on every OpenMP worker, once; whether it
    took everywhere (False where the CPU has no such mode, or torch runs another OpenMP runtime; the
    main thread's flag is then what there is)."""
    global _done
    if _done is None:
        _done = set_flush_denormal_everywhere(True)
    return _done


def set_flush_denormal_everywhere(on: bool) -> bool:
    if not torch.set_flush_denormal(on):
        return False
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    try:
        gomp = ctypes.CDLL(path if os.path.exists(path) else "libgomp.so.1")
        body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: torch.set_flush_denormal(on))
        gomp.GOMP_parallel.argtypes = [type(body), ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        gomp.GOMP_parallel.restype = None
        gomp.GOMP_parallel(body, None, 0, 0)  # 0 threads: the pool's default team, as torch's regions use
        return True
    except (OSError, AttributeError):
        return False
