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
    return int(torch.ops.batchgen_gemv.block_width())


def block(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width], the last block's missing rows zero (never stored out)."""
    n, k = weight.shape
    nb = -(-n // width)
    padded = weight.new_zeros(nb * width, k)
    padded[:n] = weight
    return padded.view(nb, width, k).transpose(1, 2).contiguous()


def gemv(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    return torch.ops.batchgen_gemv.gemv(x, blocked, n)
