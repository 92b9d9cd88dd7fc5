"""batchgen's one-pass SwiGLU activation (batchgen/kernels/silumul.cpp), built on the machine that runs
it (batchgen.kernels): silu(gate) * up read and written once, rounded where ATen's two ops round, in
the eager step and the compiled one alike (an opaque op to Inductor, so both run the same code).
Where it cannot be built, `load()` says why and the step keeps torch's ops
(batchgen.model.llama.silu_mul)."""

from __future__ import annotations

import torch

from batchgen import kernels


def load() -> str | None:
    """None once the kernel's library is loaded in this process; else why it cannot be used here."""
    return kernels.load_op("silumul", "batchgen_act::silu_mul",
                           lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As batchgen.model.llama.silu_mul: gate_up [..., 2I] -> silu(gate) * up [..., I]."""
    return torch.ops.batchgen_act.silu_mul(gate_up)
