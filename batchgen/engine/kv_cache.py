"""The KV cache: K and V buffers allocated once at full size, one row (slot) per running sequence."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        shape = (num_slots, num_kv_heads, max_len, head_dim)  # [slots, Hkv, S_max, D]
        # zeros, not empty: masked positions are still multiplied (by probability 0), so they must be finite
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
