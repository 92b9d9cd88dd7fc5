"""Paged attention on CUDA with FlashInfer's kernels (imported only where flashinfer is installed).

FlashInfer's batch prefill kernel over a paged KV cache takes every chunk of a step at once, decode
tokens (query length 1) and prompt chunks alike, with the causal mask aligned to each sequence's end,
which is what chunked prefill needs. The plan (index arrays) is made once per step and attention
variant (a sliding window, a soft cap), not per layer.
Layout: [num_blocks, block_size, Hkv, D] ("NHD").
"""

from __future__ import annotations

import flashinfer  # noqa: F401 - ImportError here makes resolve_backend fall back to the PyTorch path
import torch

from batchgen.engine.attention_metadata import AttentionMetadata


class FlashInferBackend:
    name = "flashinfer-paged"
    kv_layout = "NHD"

    def __init__(self, device: str):
        self.device = device
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        # one planned wrapper per attention variant of the model (full / sliding window, soft cap)
        self.wrappers: dict[tuple, object] = {}
        self._planned: dict[tuple, AttentionMetadata] = {}

    @property
    def wrapper(self):
        return next(iter(self.wrappers.values()))

    def _plan(self, key: tuple, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, scale: float,
              window: int | None, softcap: float | None) -> None:
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
        if key not in self.wrappers:
            self.wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.wrappers[key].plan(torch.tensor(qo, **i32), torch.tensor(kv_indptr, **i32), torch.tensor(indices, **i32),
                                torch.tensor(last, **i32), Hkv * G, Hkv, D, bs, causal=True, sm_scale=scale,
                                window_left=window - 1 if window else -1, logits_soft_cap=softcap or 0.0,
                                q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        self._planned[key] = meta

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [T, Hkv, G, D] (tokens in chunk order) -> [T, Hkv, G, D]."""
        key = (window, softcap)
        if self._planned.get(key) is not meta:  # once per step and variant, not per layer
            self._plan(key, meta, q, k_cache, scale, window, softcap)
        T, Hkv, G, D = q.shape
        out = self.wrappers[key].run(q.reshape(T, Hkv * G, D), (k_cache, v_cache))
        return out.view(T, Hkv, G, D)
