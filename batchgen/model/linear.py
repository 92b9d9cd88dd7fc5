"""A weight matrix in the layout fastest for the device's matmul kernel.

On CPU, oneDNN's prepacked (blocked) layout is what Inductor's freezing pass gives a compiled
model: `torch.ops.mkldnn._reorder_linear_weight` once at load, then `_linear_pointwise` per call.
Measured on a 2-core Zen 4 (SmolLM2-135M's matrices, one decode step's worth), against F.linear on
the checkpoint's [N, K] layout: fp32 2.0x at batch 1 and 3.2x at batch 64, bf16 1.4x / 1.6x. The
packed weight serves any batch size. Where oneDNN lacks the dtype on this CPU (fp16 without
AVX512-FP16 or AMX), or on CUDA (cuBLAS wants [N, K]), the plain layout stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACK_HINT = 64  # oneDNN's expected batch for the packing; the packed weight serves every batch


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether oneDNN has a packed CPU kernel for this dtype on this machine (checked at run time)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


class Linear:
    """y = x W^T (+ b) for x [..., K] and W [N, K]."""

    __slots__ = ("weight", "packed", "bias", "out_features", "in_features", "nbytes", "dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.dtype = weight.dtype
        self.bias = bias
        self.packed = None
        self.weight = weight  # kept only where it is the kernel's input
        if pack and can_pack(weight.dtype, weight.device):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT)
                self.weight = None
            except RuntimeError:  # an oneDNN build without this path: the plain layout works everywhere
                self.packed = None

    @property
    def layout(self) -> str:
        return "onednn-packed" if self.packed is not None else "plain [N, K]"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
