"""The paged KV cache: every layer's K and V as one pool of fixed-size blocks, allocated once.

Its size comes from a memory budget, never from max_num_seqs x max_model_len: a sequence holds
only the blocks its positions need (block tables live in batchgen.engine.block_manager). The model
reaches the buffers only through `write`, `layer` and `hnd`, so the layout stays this class's business.
"""

from __future__ import annotations

import os

import torch

from batchgen.model import hugepages


class PagedKVCache:
    # layout per layer: [num_blocks, Hkv, block_size, D] ("HND"), so one block of one head is a
    # contiguous [block_size, D] matrix for the attention's batched matmuls; kernels that want
    # [num_blocks, block_size, Hkv, D] ("NHD", FlashInfer) get that layout instead
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device, layout: str = "HND", huge_pages: bool = False):
        """`huge_pages` (CPU): the pool in one mapping on transparent huge pages (batchgen.model.hugepages),
        where a step's reads of it cost a TLB entry a 2 MiB instead of one a 4 KiB."""
        shape = ((num_blocks, num_kv_heads, block_size, head_dim) if layout == "HND"
                 else (num_blocks, block_size, num_kv_heads, head_dim))
        # zeros, not empty: a masked position still multiplies (by probability 0), so it must be finite
        if huge_pages and torch.device(device).type == "cpu":
            pool = hugepages.arena([(shape, dtype)] * (2 * num_layers))
        else:
            pool = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
        self.k, self.v = pool[:num_layers], pool[num_layers:]
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * bytes_per_element

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def hnd(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V pools seen as [num_blocks, Hkv, block_size, D], whatever the layout (NHD as a
        transposed view): for a kernel that writes the cache itself (batchgen.model.rope.rope_kv)."""
        if self.layout == "HND":
            return self.k[i], self.v[i]
        return self.k[i].transpose(1, 2), self.v[i].transpose(1, 2)

    def write(self, i: int, block_idx: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, Hkv, D] for positions at (block_idx [T], offset [T])."""
        if self.layout == "HND":
            self.k[i][block_idx, :, offset] = k
            self.v[i][block_idx, :, offset] = v
        else:
            self.k[i][block_idx, offset] = k
            self.v[i][block_idx, offset] = v


def free_memory_bytes(device: str) -> int:
    """What the device has free now: CUDA's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
