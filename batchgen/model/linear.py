"""A weight matrix in the layout fastest for the device's matmul kernel.

On CPU, oneDNN's prepacked (blocked) layout is what Inductor's freezing pass gives a compiled
model: `torch.ops.mkldnn._reorder_linear_weight` once at load, then `_linear_pointwise` per call.
Measured on a 2-core Zen 4 (SmolLM2-135M's matrices, one decode step's worth), against F.linear on
the checkpoint's [N, K] layout: fp32 2.0x at batch 1 and 3.2x at batch 64, bf16 1.4x / 1.6x. The
packed weight serves any batch size. Where oneDNN lacks the dtype on this CPU (fp16 without
AVX512-FP16 or AMX), or on CUDA (cuBLAS wants [N, K]), the plain layout stays.

float32 on CPU goes one step further where a C++ compiler is at hand: batchgen's own kernel
(batchgen.model.gemv), with the weight in column blocks [N / BN, K, BN] that it streams once. In the
engine on the same 2-core Zen 4 (SmolLM2-135M fp32, the two kernels' engines stepping alternately in
one process): a batch-1 step's 121 matmuls took 13.1 ms against oneDNN's 16.0 (the profiler's sums;
41 GB/s, the probe's peak read bandwidth); decode steps 1.09x at batch 1 and 1.20x at batch 8
(compiled), 1.27x at batch 64 and prefill 1.33x (eager), with the same greedy tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.config import FP32_KERNELS

_PACK_HINT = 64  # oneDNN's expected batch for the packing; the packed weight serves every batch
# float32's CPU kernel (FP32_KERNELS): "gemv" (batchgen.model.gemv, built on this machine), "onednn"
# (the prepacked oneDNN kernel), or "auto" (gemv where it builds, else onednn; the engine narrows auto
# further, per batch band, in batchgen.engine.precision.resolve_fp32_kernel). One layout is kept, not
# both: a second copy of every weight would double the model's memory for a choice per step.


def let_inductor_call_prepacked() -> None:
    """Make Inductor call oneDNN's prepacked linear as an opaque kernel (a "fallback") inside a
    compiled step, and fuse everything around it. Its own lowering of mkldnn._linear_pointwise accepts
    only weights it packed itself while freezing a module (graph constants), and ours are packed at
    load and passed in as inputs. A torch.library custom op would do the same through public API but
    costs ~13 us more per call (its Python dispatch), ~1.5 ms over a step's 121 matmuls; the fallback
    costs ~2 us. Replacing the lowering is process-wide: a frozen module compiled later in the same
    process still runs correctly, with the kernel called unfused."""
    from torch._inductor import lowering, mkldnn_lowerings  # noqa: F401 - the latter registers the lowering

    # .binary: Inductor's fusion pass folds a residual add into the matmul (y = x W^T + other), which
    # then needs the same, and a shape function for tracing (PyTorch registers none): other's shape
    binary = torch.ops.mkldnn._linear_pointwise.binary
    if not torch._C._dispatch_has_kernel_for_dispatch_key(binary.name(), "Meta"):
        torch.library.register_fake("mkldnn::_linear_pointwise.binary")(
            lambda X, other, W, B, attr: other.new_empty(other.shape))
    for op in (torch.ops.mkldnn._linear_pointwise.default, binary):
        if lowering.lowerings.get(op) is not None and op not in lowering.fallbacks:
            lowering.lowerings.pop(op)
            lowering.make_fallback(op)


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


def fp32_kernel(choice: str, device: torch.device | str) -> tuple[int | None, str]:
    """(the gemv kernel's block width, or None for oneDNN/plain; why) for `choice` in FP32_KERNELS."""
    if choice not in FP32_KERNELS:
        raise ValueError(f"fp32 kernel {choice!r}: one of {', '.join(FP32_KERNELS)}")
    if choice == "onednn" or torch.device(device).type != "cpu":
        return None, "asked for" if choice == "onednn" else "not on CPU"
    from batchgen.model import gemv

    width = gemv.load()
    if isinstance(width, str):
        if choice == "gemv":
            raise RuntimeError(f"fp32 kernel gemv asked for, but it cannot be built here: {width}")
        return None, width
    return width, "built on this machine"


class Linear:
    """y = x W^T (+ b) for x [..., K] and W [N, K]. `gemv_width`: hold a float32 W in the gemv
    kernel's column blocks of that width (batchgen.model.gemv) instead of oneDNN's packing."""

    __slots__ = ("weight", "packed", "blocked", "gated", "tiled", "amx", "bias", "out_features", "in_features",
                 "nbytes", "dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 gemv_width: int | None = None, bf16_tiles: bool = False):
        """`bf16_tiles`: hold a bfloat16 W in the batch-invariant bgemm kernel's tiles
        (batchgen.model.bgemm; the caller has loaded it) instead of oneDNN's packing."""
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.dtype = weight.dtype
        self.bias = bias
        self.packed = self.blocked = self.gated = self.tiled = None
        self.amx = False
        self.weight = weight  # kept only where it is the kernel's input
        if pack and gemv_width and weight.dtype == torch.float32 and weight.device.type == "cpu":
            from batchgen.model.gemv import block

            self.blocked, self.weight = block(weight, gemv_width), None
        elif pack and bf16_tiles and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            from batchgen.model import bgemm

            self.tiled, self.amx, self.weight = bgemm.pack(weight), bgemm.isa() == "amx", None
        elif pack and can_pack(weight.dtype, weight.device):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT)
                self.weight = None
            except RuntimeError:  # an oneDNN build without this path: the plain layout works everywhere
                self.packed = None

    def fuse_swiglu(self) -> bool:
        """Hold a [gate; up] weight as the fused kernel's blocks so that `swiglu(x)` returns
        silu(gate) * up from one kernel call: gemv_swiglu's (batchgen.model.gemv.block_swiglu) for a
        gemv-blocked float32 weight, bgemm_swiglu's (batchgen.model.bgemm.pack_swiglu) for bf16 tiles.
        False where this weight is on neither kernel (or has a bias): the caller keeps the matmul and
        the activation apart."""
        if self.bias is not None or self.out_features % 2:
            return False
        if self.blocked is not None:
            from batchgen.model import gemv

            width = self.blocked.shape[2]
            self.gated, self.blocked = gemv.block_swiglu(gemv.unblock(self.blocked, self.out_features), width), None
            return True
        if self.tiled is not None:
            from batchgen.model import bgemm

            self.gated = bgemm.pack_swiglu(bgemm.unpack(self.tiled, self.out_features, self.in_features))
            self.tiled = None
            return True
        return False

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wg^T) * (x Wu^T) [.., out_features / 2], once fuse_swiglu has taken this weight."""
        if self.gated.dtype == torch.bfloat16:
            return torch.ops.batchgen_bgemm.bgemm_swiglu(x, self.gated, self.out_features // 2, int(self.amx))
        return torch.ops.batchgen_gemv.gemv_swiglu(x, self.gated, self.out_features // 2)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + x W^T (+ b): a residual stream plus this layer's output. On the gemv and bgemm kernels
        the add is the kernel's epilogue (gemv_add, bgemm_add: the same bits, one pass less over the
        output)."""
        if self.bias is None and h.dtype == self.dtype:
            if self.blocked is not None and h.dtype == torch.float32:
                return torch.ops.batchgen_gemv.gemv_add(x, self.blocked, self.out_features, h)
            if self.tiled is not None and h.dtype == torch.bfloat16:
                return torch.ops.batchgen_bgemm.bgemm_add(x, self.tiled, self.out_features, int(self.amx), h)
        return h + self(x)

    @property
    def kernel(self) -> str:
        """The matmul kernel's short name, as an EnginePlan names it: gemv, bgemm, onednn or torch."""
        held = self.gated if self.gated is not None else self.blocked if self.blocked is not None else self.tiled
        if held is not None:
            return "bgemm" if held.dtype == torch.bfloat16 else "gemv"
        return "onednn" if self.packed is not None else "torch"

    @property
    def layout(self) -> str:
        if self.gated is not None and self.gated.dtype == torch.bfloat16:
            return f"bgemm-tiled ({'AMX' if self.amx else 'AVX512_BF16'}), SwiGLU in the kernel"
        if self.gated is not None:
            return f"gemv-blocked [N/{self.gated.shape[2]}, K, {self.gated.shape[2]}], SwiGLU in the kernel"
        if self.blocked is not None:
            return f"gemv-blocked [N/{self.blocked.shape[2]}, K, {self.blocked.shape[2]}]"
        if self.tiled is not None:
            return f"bgemm-tiled ({'AMX' if self.amx else 'AVX512_BF16'})"
        return "onednn-packed" if self.packed is not None else "plain [N, K]"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is not None and self.gated.dtype == torch.bfloat16:  # the plain product from the tiles
            i = self.out_features // 2
            y = torch.ops.batchgen_bgemm.bgemm(x, self.gated, self.gated.shape[0] * 16, int(self.amx))
            y = y.unflatten(-1, (-1, 2, 16))  # [gate 16 | up 16] a task
            return torch.cat([y[..., 0, :].flatten(-2)[..., :i], y[..., 1, :].flatten(-2)[..., :i]], dim=-1)
        if self.gated is not None:  # the plain product from fuse_swiglu's blocks: [gate h | up h] a block
            nb, _, width = self.gated.shape
            y = torch.ops.batchgen_gemv.gemv(x, self.gated, nb * width).unflatten(-1, (nb, 2, width // 2))
            i = self.out_features // 2
            return torch.cat([y[..., 0, :].flatten(-2)[..., :i], y[..., 1, :].flatten(-2)[..., :i]], dim=-1)
        if self.blocked is not None:
            y = torch.ops.batchgen_gemv.gemv(x, self.blocked, self.out_features)
            return y if self.bias is None else y + self.bias
        if self.tiled is not None:
            y = torch.ops.batchgen_bgemm.bgemm(x, self.tiled, self.out_features, int(self.amx))
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# ---- int4 weight-only ------------------------------------------------------------------------------
# PyTorch's own CPU kernel for 4-bit weights (what gpt-fast's and torchao's int4 weight-only use):
# codes 0..15 in groups of INT4_GROUP along K, each group with a scale and a zero,
#     w = (q - 8) * scale + zero,
# activations in bfloat16 (with float32 activations the op falls back to a reference path that
# measured 15x slower here). Quantizing by each group's min and max (zero = min + 8 scale) is exactly
# GGUF's Q4_1 (w = d q + m, with d = scale and m = min): the shipped SmolLM2 weights are Q4_1 values
# in groups of 32, so on them this recovers the shipped codes, and the layers compute with the weights
# the model was published with (up to float rounding of scale and zero).
INT4_GROUP = 32


def can_int4(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes int32 [N, K] in 0..15, scale_and_zero float32 [K / group, N, 2])."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of the group ({group})")
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    return codes, torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1).contiguous()


def dequantize_int4(codes: torch.Tensor, scale_zero: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    scale = scale_zero[..., 0].t().repeat_interleave(group, dim=1)
    zero = scale_zero[..., 1].t().repeat_interleave(group, dim=1)
    return (codes.float() - 8) * scale + zero


class Int4Linear:
    """y = x W^T (+ b) with W held as 4-bit codes and per-group scale/zero, x in bfloat16."""

    __slots__ = ("packed", "scale_zero", "bias", "out_features", "in_features", "nbytes", "dtype", "group")
    layout = "int4 weight-only (PyTorch int4pack)"
    kernel = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = INT4_GROUP):
        self.out_features, self.in_features = weight.shape
        self.dtype, self.group, self.bias = torch.bfloat16, group, bias
        codes, scale_zero = quantize_int4(weight, group)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scale_zero = scale_zero.to(self.dtype)
        self.nbytes = self.packed.numel() * self.packed.element_size() + self.scale_zero.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), self.packed, self.group,
                                                       self.scale_zero)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + x W^T (+ b), as Linear.add_to."""
        return h + self(x)
