"""batchgen's one-pass RoPE (batchgen/kernels/rope.cpp), built on the machine that runs it
(batchgen.kernels): the same bits as batchgen.model.llama.apply_rope's eager ops, without their
temporaries. The native engine's CPU step uses it, eager and compiled alike; where it cannot be
built, `load()` says why and the step keeps apply_rope."""

from __future__ import annotations

import torch

from batchgen import kernels


def load() -> str | None:
    """None once the kernel's library is loaded in this process; else why it cannot be used here."""
    why = kernels.load("rope")
    if why is not None:
        return why
    if not torch._C._dispatch_has_kernel_for_dispatch_key("batchgen_rope::rope", "Meta"):
        # a shape-only kernel, so that a compiled step traces through the op (opaque to Inductor)
        torch.library.register_fake("batchgen_rope::rope")(
            lambda x, cos, sin: x.new_empty((x.shape[0], x.shape[1], x.shape[2])))
    return None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """As batchgen.model.llama.apply_rope, for the step's shapes: x [T, H, D], cos and sin [T, 1, D]."""
    return torch.ops.batchgen_rope.rope(x, cos, sin_signed)
