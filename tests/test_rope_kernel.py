"""batchgen's one-pass RoPE (batchgen/kernels/rope.cpp) against batchgen.model.llama.apply_rope's eager
ops, bit for bit (each product and the sum rounded to the dtype where ATen rounds them), on the step's
shapes: q and k cut from the fused qkv output (strided rows). Then inside a compiled function (an
opaque op) it gives the eager bits, which is why both steps call it. And `rope_kv`, the eager step's
RoPE with the KV write in one pass: the bits of the two RoPE calls and PagedKVCache.write."""

import pytest
import torch

from batchgen.engine.kv_cache import PagedKVCache
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
@pytest.mark.parametrize("shape", [(1, 9, 64), (300, 9, 64), (37, 3, 64), (5, 2, 8), (7, 3, 80)])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("T,D", [(300, 64), (5, 80), (1, 8)])
def test_rope_kv_has_the_bits_of_rope_then_the_cache_write(op, dtype, layout, T, D):
    H, Hkv, bs = 9, 3, 16
    gen = torch.Generator().manual_seed(T + D)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=gen) * 4).to(dtype)
    # NaN (ATen's vector ops write it as 0xFFFF, c10 as 0x7FC0: both kernels take c10's), inf, a denormal
    qkv[0, :3] = torch.tensor([float("nan"), float("inf"), 1e-40])
    q, k, v = (x.unflatten(-1, (-1, D)) for x in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    _, cos, sin = inputs(T, 1, D, dtype, seed=T)
    blocks = T // bs + 3
    slots = torch.randperm(blocks * bs, generator=gen)[:T]  # tokens scattered over the blocks
    block_idx, offset = slots // bs, slots % bs
    want, got = (PagedKVCache(2, blocks, bs, Hkv, D, dtype, "cpu", layout) for _ in range(2))
    want.write(1, block_idx, offset, op(k, cos, sin), v)  # the compiled step's path (`op`: the eager ops' bits)
    q_got = rope.rope_kv(q, k, v, cos, sin, *got.hnd(1), block_idx, offset)
    assert torch.equal(q_got.view(torch.uint8), op(q, cos, sin).view(torch.uint8))
    assert torch.equal(q_got[1:], apply_rope(q[1:], cos[1:], sin[1:]))
    for a, b in zip(want.layer(1), got.layer(1)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not got.layer(0)[0].any()  # the other layer untouched


def test_rope_kv_refuses_a_slot_outside_the_cache(op):
    q, cos, sin = inputs(4, 2, 8, torch.float32)
    kv = PagedKVCache(1, 2, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope.rope_kv(q, q, q, cos, sin, *kv.hnd(0), torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(RuntimeError, match="caches must be"):
        rope.rope_kv(q, q, q, cos, sin, *PagedKVCache(1, 2, 4, 2, 8, torch.bfloat16, "cpu").hnd(0),
                     torch.zeros(4, dtype=torch.long), torch.arange(4))
