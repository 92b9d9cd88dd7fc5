"""batchgen's float32 CPU matmul for decode (batchgen/kernels/gemv.cpp), built on the machine that
runs it (batchgen.kernels). Where it cannot be built, `load()` says why and the caller keeps
oneDNN's kernel."""

from __future__ import annotations

import torch

from batchgen import kernels


def load() -> int | str:
    """The kernel's column-block width (an int) once its library is loaded in this process; or, as
    a str, why it cannot be used here."""
    why = kernels.load_op("gemv", "batchgen_gemv::gemv", lambda x, w, n: x.new_empty((*x.shape[:-1], n)))
    if why is not None:
        return why
    kernels.load_op("gemv", "batchgen_gemv::gemv_swiglu", lambda x, w, n: x.new_empty((*x.shape[:-1], n)))
    kernels.load_op("gemv", "batchgen_gemv::gemv_add", lambda x, w, n, h: torch.empty_like(h))
    return int(torch.ops.batchgen_gemv.block_width())


def block(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width], the last block's missing rows zero (never stored out)."""
    n, k = weight.shape
    nb = -(-n // width)
    padded = weight.new_zeros(nb * width, k)
    padded[:n] = weight
    return padded.view(nb, width, k).transpose(1, 2).contiguous()


def unblock(blocked: torch.Tensor, n: int) -> torch.Tensor:
    """`block`'s inverse: [NB, K, width] -> [n, K]."""
    nb, k, width = blocked.shape
    return blocked.transpose(1, 2).reshape(nb * width, k)[:n]


def block_swiglu(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """SwiGLU's fused [gate; up] weight [2I, K] -> [ceil(I / h), K, width] (h = width / 2): block b holds
    gate rows [b h, b h + h) then the same up rows, so that gemv_swiglu applies the activation to a
    block's outputs as they leave its registers (the last block's missing rows zero)."""
    two_i, k = gate_up.shape
    i, h = two_i // 2, width // 2
    nb = -(-i // h)
    halves = gate_up.new_zeros(2, nb * h, k)
    halves[0, :i], halves[1, :i] = gate_up[:i], gate_up[i:]
    return halves.view(2, nb, h, k).permute(1, 3, 0, 2).reshape(nb, k, width).contiguous()


def gemv(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    return torch.ops.batchgen_gemv.gemv(x, blocked, n)


def swiglu(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) [.., n] from `block_swiglu`'s weight: the bits of gemv then the silumul
    kernel, without the [.., 2n] product in memory."""
    return torch.ops.batchgen_gemv.gemv_swiglu(x, blocked, n)


def add(x: torch.Tensor, blocked: torch.Tensor, n: int, h: torch.Tensor) -> torch.Tensor:
    """h + x W^T [.., n]: the bits of gemv then the add, the residual added in the kernel's epilogue."""
    return torch.ops.batchgen_gemv.gemv_add(x, blocked, n, h)
