"""batchgen's fixed-order RMSNorm (batchgen/kernels/rmsnorm.cpp), built on the machine that runs it
(batchgen.kernels): each row's mean of squares added in one order, whatever the batch, in the eager
step and the compiled one alike. The native engine's CPU step uses it (a batch-invariant run needs
it); where it cannot be built, `load()` says why and the step keeps torch's norm
(batchgen.model.llama.rms_norm)."""

from __future__ import annotations

import torch

from batchgen import kernels


def load() -> str | None:
    """None once the kernel's library is loaded in this process; else why it cannot be used here."""
    # opaque to Inductor, which would otherwise fuse the norm and choose its own order of adding
    return kernels.load_op("rmsnorm", "batchgen_rmsnorm::rms_norm", lambda x, w, eps: torch.empty_like(x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As batchgen.model.llama.rms_norm (float32 inside, rounded to x's dtype before the weight)."""
    return torch.ops.batchgen_rmsnorm.rms_norm(x, weight, eps)
