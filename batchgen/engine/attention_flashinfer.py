"""Paged attention on CUDA with FlashInfer's kernels (imported only where flashinfer is installed).

FlashInfer's batch prefill kernel over a paged KV cache takes every chunk of a step at once, decode
tokens (query length 1) and prompt chunks alike, with the causal mask aligned to each sequence's end,
which is what chunked prefill needs. The plan (index arrays) is made once per step, not per layer.
Layout: [num_blocks, block_size, Hkv, D] ("NHD").
"""

from __future__ import annotations

import flashinfer  # noqa: F401 - ImportError here makes select_backend fall back to the PyTorch path
import torch

from batchgen.engine.attention import AttentionMetadata


class FlashInferBackend:
    name = "flashinfer-paged"
    kv_layout = "NHD"

    def __init__(self, device: str):
        self.device = device
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self._planned: AttentionMetadata | None = None

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        bs = k_cache.shape[1]
        qo, kv_indptr, indices, last = [0], [0], [], []
        for q_len, kv_len, blocks in zip(meta.q_lens, meta.seq_lens, meta.block_tables):
            pages = -(-kv_len // bs)
            qo.append(qo[-1] + q_len)
            kv_indptr.append(kv_indptr[-1] + pages)
            indices += blocks[:pages]
            last.append(kv_len - (pages - 1) * bs)
        i32 = dict(dtype=torch.int32, device=self.device)
        _, Hkv, G, D = q.shape
        self.wrapper.plan(torch.tensor(qo, **i32), torch.tensor(kv_indptr, **i32), torch.tensor(indices, **i32),
                          torch.tensor(last, **i32), Hkv * G, Hkv, D, bs, causal=True, sm_scale=scale,
                          q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        self._planned = meta

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
        """q [T, Hkv, G, D] (tokens in chunk order) -> [T, Hkv, G, D]."""
        if self._planned is not meta:
            self._plan(meta, q, k_cache, scale)
        T, Hkv, G, D = q.shape
        out = self.wrapper.run(q.reshape(T, Hkv * G, D), (k_cache, v_cache))
        return out.view(T, Hkv, G, D)
