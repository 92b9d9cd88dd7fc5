"""Attention over the paged KV cache, batched over every sequence of a step with no Python loop.

Each query tile (one decode token, or up to PREFILL_TILE tokens of one prompt chunk) is paired with
the key tiles it may attend to: runs of consecutive blocks of its own sequence, about DECODE_KEYS or
PREFILL_KEYS positions each. A pair computes its scores as one matmul, and the pairs of a query tile
are combined with a split softmax (running max and sum, as flash-decoding does). A row reads only
its own blocks: no padding to the longest context in the batch, only its last key tile's unused
tail, masked. Decode tiles, prefill tiles and speculative-verify tiles (1 + k tokens) are separate
calls, so a decode token is never padded to a prefill tile's width.

On CPU, `CpuPagedAttention` runs the same plan through batchgen's C++ kernel
(batchgen/kernels/attention.cpp): one call a layer and group, reading the blocks in place. On CUDA,
`FlashInferBackend` runs a real paged kernel instead when flashinfer is installed.
"""

from __future__ import annotations

import torch

from batchgen import kernels
from batchgen.engine.attention_metadata import AttentionMetadata, TileGroup

def _tile_attention(q: torch.Tensor, g: TileGroup, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [N, Qt, Hkv, G, D] -> out [N, Qt, Hkv, G, D]; caches [num_blocks, Hkv, bs, D]."""
    N, Qt, Hkv, G, D = q.shape
    (P, KT), bs, QG = g.pair_blocks.shape, k_cache.shape[2], Qt * G
    S = KT * bs
    keys = k_cache[g.pair_blocks].transpose(1, 2).reshape(P, Hkv, S, D)  # [P, Hkv, S, D]
    values = v_cache[g.pair_blocks].transpose(1, 2).reshape(P, Hkv, S, D)
    qp = q[g.pair_tile].permute(0, 2, 1, 3, 4).reshape(P, Hkv, QG, D)
    s = torch.matmul(qp, keys.transpose(-1, -2)).float().mul_(scale)  # [P, Hkv, Qt*G, S]
    if softcap is not None:  # Gemma 2: scores squashed into (-cap, cap)
        s = torch.tanh(s.div_(softcap)).mul_(softcap)
    key_pos = g.pair_pos0[:, None] + torch.arange(S, device=q.device)  # [P, S]
    q_pos = g.q_pos[g.pair_tile][:, :, None]  # [P, Qt, 1]
    hidden = key_pos[:, None, :] > q_pos  # [P, Qt, S]: causal + past the context
    if window is not None:  # sliding window: only the last `window` positions
        hidden |= key_pos[:, None, :] <= q_pos - window
    s.view(P, Hkv, Qt, G, S).masked_fill_(hidden[:, None, :, None, :], float("-inf"))
    m_pair = s.amax(dim=-1)  # [P, Hkv, QG]
    idx = g.pair_tile[:, None, None].expand_as(m_pair)
    m = torch.full((N, Hkv, QG), float("-inf"), device=q.device).scatter_reduce_(0, idx, m_pair, "amax")
    e = torch.exp(s.sub_(m[g.pair_tile][..., None]))  # masked -> 0
    l = torch.zeros((N, Hkv, QG), device=q.device).index_add_(0, g.pair_tile, e.sum(dim=-1))
    o = torch.matmul(e.to(values.dtype), values)  # [P, Hkv, QG, D]
    out = torch.zeros((N, Hkv, QG, D), device=q.device).index_add_(0, g.pair_tile, o.float())
    out.div_(l[..., None])
    return out.view(N, Hkv, Qt, G, D).permute(0, 2, 1, 3, 4).to(q.dtype)


class TorchPagedAttention:
    """The PyTorch path (CPU, and CUDA without flashinfer)."""

    name = "torch-paged"
    kv_layout = "HND"

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [T, Hkv, G, D] for the step's tokens -> [T, Hkv, G, D]."""
        out = torch.empty_like(q)
        for g in (meta.decode, meta.prefill, meta.verify):  # at most three groups: not a loop over sequences
            if g is None:
                continue
            o = _tile_attention(q[g.token_idx], g, k_cache, v_cache, scale, window, softcap)
            if g.valid is None:
                out[g.token_idx.view(-1)] = o.reshape(-1, *q.shape[1:])
            else:
                out[g.token_idx[g.valid]] = o[g.valid]
        return out


class CpuPagedAttention(TorchPagedAttention):
    """batchgen's C++ kernel for every group of a step (CPU, the "HND" cache): no gathered copies of
    the blocks, and a query row's result independent of its batch (see attention.cpp)."""

    name = "cpu-paged"

    def __init__(self):
        why = kernels.load("attention")
        if why is not None:
            raise RuntimeError(f"batchgen's attention kernel is unavailable here ({why})")

    @staticmethod
    def bf16_isa() -> str:
        """What a bfloat16 cache runs on here: "amx" (tiles), "avx512-bf16" (VDPBF16PS) or "vector";
        AMX and VDPBF16PS round apart, so a run's conditions name it."""
        return str(torch.ops.batchgen_attention.bf16_isa())

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        # one call for every group: the kernel reads each tile's queries where they are in q and writes
        # each token's output there (no gathered copy, no scatter)
        groups = [g for g in (meta.decode, meta.prefill, meta.verify) if g is not None]
        return torch.ops.batchgen_attention.paged_step(
            q, k_cache, v_cache, [g.token_idx for g in groups], [g.q_pos for g in groups],
            [g.pair_tile for g in groups], [g.pair_blocks for g in groups], [g.pair_pos0 for g in groups], scale,
            window or 0, softcap or 0.0)


def resolve_backend(device: str, name: str = "auto") -> tuple[str, str]:
    """(cpu | flashinfer | torch, why) for `--attention-backend name`. `auto`: a real paged-attention
    kernel where one is installed for the device (FlashInfer on CUDA, batchgen's C++ kernel on CPU
    where it builds), else the PyTorch path. `cpu` or `flashinfer` ask for one: it must load."""
    if name == "cpu" or (name == "auto" and device == "cpu"):
        why = kernels.load("attention")
        if why is None:
            return "cpu", "batchgen's C++ paged kernel" + (" (auto on CPU)" if name == "auto" else "")
        if name == "cpu":
            raise RuntimeError(f"batchgen's attention kernel is unavailable here ({why})")
        return "torch", f"the PyTorch path: batchgen's C++ kernel does not build here ({why})"
    if name == "flashinfer" or (name == "auto" and device.startswith("cuda")):
        try:
            from batchgen.engine.attention_flashinfer import FlashInferBackend  # noqa: F401 - imports flashinfer
        except ImportError:
            if name == "flashinfer":
                raise
            return "torch", "the PyTorch path: FlashInfer is not installed"
        return "flashinfer", "FlashInfer's paged kernel" + (" (auto on CUDA)" if name == "auto" else "")
    return "torch", "the PyTorch path, as requested"


def make_backend(name: str, device: str):
    """The backend a plan names (resolve_backend's first answer)."""
    if name == "cpu":
        return CpuPagedAttention()
    if name == "flashinfer":
        from batchgen.engine.attention_flashinfer import FlashInferBackend

        return FlashInferBackend(device)
    return TorchPagedAttention()
