"""batchgen's one-pass RoPE (batchgen/kernels/rope.cpp), built on the machine that runs it
(batchgen.kernels): the same bits as batchgen.model.llama.apply_rope's eager ops, without their
temporaries. The native engine's CPU step uses it, eager and compiled alike; where it cannot be
built, `load()` says why and the step keeps apply_rope."""

from __future__ import annotations

import torch

from batchgen import kernels


def load() -> str | None:
    """None once the kernel's library is loaded in this process; else why it cannot be used here."""
    return kernels.load_op("rope", "batchgen_rope::rope", lambda x, cos, sin: x.new_empty(x.shape))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """As batchgen.model.llama.apply_rope, for the step's shapes: x [T, H, D], cos and sin [T, 1, D]."""
    return torch.ops.batchgen_rope.rope(x, cos, sin_signed)
