"""batchgen's batch-invariant bfloat16 CPU matmul (batchgen/kernels/bgemm.cpp), built on the machine
that runs it (batchgen.kernels): each output summed over K in one fixed order, on AMX tiles or
AVX512_BF16 dot products, whatever the batch. Where the CPU has neither, `load()` says why and
bf16 stays on oneDNN (whose rows depend on the batch)."""

from __future__ import annotations

import torch

from batchgen import kernels

TN, TK = 16, 32  # a packed tile: 32 K x 16 columns


def load() -> str | None:
    """None once the kernel's library is loaded in this process; else why it cannot be used here."""
    why = kernels.load_op("bgemm", "batchgen_bgemm::bgemm", lambda x, w, n, use_amx: x.new_empty((*x.shape[:-1], n)))
    if why is None:
        kernels.load_op("bgemm", "batchgen_bgemm::bgemm_swiglu",
                        lambda x, w, n, use_amx: x.new_empty((*x.shape[:-1], n)))
        kernels.load_op("bgemm", "batchgen_bgemm::bgemm_add", lambda x, w, n, use_amx, h: torch.empty_like(h))
    return why


def isa() -> str:
    """The instructions the kernel runs on here: "amx" or "avx512-bf16" (they round differently)."""
    return str(torch.ops.batchgen_bgemm.isa())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 [N'/16, K'/32, 16, 16, 2]: N padded to 32 (two tiles a step), K to 32, with zeros."""
    n, k = weight.shape
    n_pad, k_pad = -(-n // (2 * TN)) * 2 * TN, -(-k // TK) * TK
    w = weight.new_zeros(n_pad, k_pad, dtype=torch.bfloat16)
    w[:n, :k] = weight
    return w.view(n_pad // TN, TN, k_pad // TK, TK // 2, 2).permute(0, 2, 3, 1, 4).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack`'s inverse: the [n, k] bf16 weight."""
    nb, kb = packed.shape[:2]
    return packed.permute(0, 3, 1, 2, 4).reshape(nb * TN, kb * TK)[:n, :k]


def pack_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's [gate; up] weight [2I, K] -> `pack`'s tiles with gate block j (16 columns) beside up
    block j, so that one task's 32 columns give 16 activations (bgemm_swiglu); I padded to 16 with zeros."""
    two_i, k = gate_up.shape
    i = two_i // 2
    nb = -(-i // TN)
    halves = gate_up.new_zeros(2, nb * TN, k, dtype=torch.bfloat16)
    halves[0, :i], halves[1, :i] = gate_up[:i], gate_up[i:]
    return pack(halves.view(2, nb, TN, k).transpose(0, 1).reshape(2 * nb * TN, k))


def bgemm(x: torch.Tensor, packed: torch.Tensor, n: int, use_amx: bool = True) -> torch.Tensor:
    return torch.ops.batchgen_bgemm.bgemm(x, packed, n, int(use_amx and isa() == "amx"))


def add(x: torch.Tensor, packed: torch.Tensor, n: int, h: torch.Tensor, use_amx: bool = True) -> torch.Tensor:
    """h + x W^T (bf16): the bits of bgemm then ATen's add, in one pass."""
    return torch.ops.batchgen_bgemm.bgemm_add(x, packed, n, int(use_amx and isa() == "amx"), h)
