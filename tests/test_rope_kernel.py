"""batchgen's one-pass RoPE (batchgen/kernels/rope.cpp) against batchgen.model.llama.apply_rope's eager
ops, bit for bit (each product and the sum rounded to the dtype where ATen rounds them), on the step's
shapes: q and k cut from the fused qkv output (strided rows). Then inside a compiled function (an
opaque op) it gives the eager bits, which is why both steps call it."""

import pytest
import torch

from batchgen.model import rope
from batchgen.model.llama import apply_rope
from conftest import kernel_op


@pytest.fixture(scope="module")
def op():
    return kernel_op("rope", rope.load(), rope.apply_rope)


def inputs(T, H, D, dtype, seed=0):
    """q [T, H, D] as the step cuts it from qkv (rows not contiguous), cos and signed sin [T, 1, D]."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (H + 4) * D, generator=gen) * 4).to(dtype)
    angle = torch.randn(T, 1, D // 2, generator=gen) * 50
    angle = torch.cat((angle, angle), dim=-1)
    sign = torch.cat((-torch.ones(D // 2), torch.ones(D // 2)))
    return qkv[:, :H * D].unflatten(-1, (H, D)), angle.cos().to(dtype), (angle.sin() * sign).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 9, 64), (300, 9, 64), (37, 3, 64), (5, 2, 8)])
def test_same_bits_as_the_eager_ops(op, dtype, shape):
    q, cos, sin = inputs(*shape, dtype)
    assert q.is_contiguous() == (shape[0] == 1)  # one token's rows are contiguous; more are strided
    got = op(q, cos, sin)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.equal(got, apply_rope(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_and_eager_give_the_same_bits(op, dtype):
    q, cos, sin = inputs(512, 9, 64, dtype, seed=3)

    def step(x, c, s):
        return op(x * 2, c, s) + 1

    compiled = torch.compile(step, dynamic=True, options={"emulate_precision_casts": True})
    assert torch.equal(compiled(q, cos, sin), step(q, cos, sin))
    assert torch.equal(compiled(q[:1], cos[:1], sin[:1]), step(q, cos, sin)[:1])  # a row alone


def test_bad_input_is_refused_clearly(op):
    q, cos, sin = inputs(4, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(q, cos.bfloat16(), sin)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        op(q, cos[:2], sin[:2])
    with pytest.raises(RuntimeError, match="D even"):
        op(q[..., :7], cos[..., :7], sin[..., :7])
