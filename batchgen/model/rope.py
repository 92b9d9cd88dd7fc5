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


def rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, block_idx: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """`apply_rope` on q (returned) and k, with k and v written to the paged cache (pools seen as
    [blocks, Hkv, block_size, D], PagedKVCache.hnd) at (block_idx, offset): one pass instead of two
    RoPE calls and the cache's index_put, the same bits. The eager step's (a prompt chunk's) path; the
    compiled decode step keeps the op-by-op one, whose KV write Inductor fuses."""
    return torch.ops.batchgen_rope.rope_kv(q, k, v, cos, sin_signed, k_cache, v_cache, block_idx, offset)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """As batchgen.model.llama.apply_rope, for the step's shapes: x [T, H, D], cos and sin [T, 1, D]."""
    return torch.ops.batchgen_rope.rope(x, cos, sin_signed)
