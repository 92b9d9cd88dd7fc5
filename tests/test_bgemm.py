"""batchgen's batch-invariant bf16 matmul (batchgen/kernels/bgemm.cpp): the product within bf16's
rounding of a float32 reference, and every row's bits independent of the rows beside it, the batch
size and the threads, on each instruction set the CPU has (AMX tiles, AVX512_BF16 dot products)."""

from __future__ import annotations

import pytest
import torch

from batchgen import kernels
from batchgen.model import bgemm
from batchgen.model.linear import Linear
from conftest import on_one_thread

WHY = bgemm.load()
# skipped (loudly) only on a CPU without bf16 dot products; where it has them, a kernel that does not
# build fails here
HAS_BF16_DOT = "avx512_bf16" in kernels._cpu_flags()
pytestmark = pytest.mark.needs(f"bgemm kernel unavailable: {WHY}" if WHY and not HAS_BF16_DOT else None,
                               "BATCHGEN_REQUIRE_BGEMM")


def paths() -> list[bool]:
    return [True, False] if bgemm.isa() == "amx" else [False]


@pytest.mark.parametrize("n,k", [(960, 576), (100, 70), (49152, 64), (48, 1536)])
def test_matches_a_float32_reference_and_pads_any_shape(n, k):
    torch.manual_seed(0)
    w = (torch.randn(n, k) * 0.05).bfloat16()
    x = torch.randn(37, k).bfloat16()
    ref = x.float() @ w.float().t()
    packed = bgemm.pack(w)
    for amx in paths():
        y = bgemm.bgemm(x, packed, n, amx)
        assert y.shape == (37, n) and y.dtype == torch.bfloat16
        assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_a_rows_bits_do_not_depend_on_its_batch():
    torch.manual_seed(1)
    w = (torch.randn(640, 576) * 0.05).bfloat16()
    packed = bgemm.pack(w)
    x = torch.randn(300, 576).bfloat16()
    for amx in paths():
        full = bgemm.bgemm(x, packed, 640, amx)
        alone = torch.cat([bgemm.bgemm(x[i:i + 1], packed, 640, amx) for i in range(0, 300, 13)])
        assert torch.equal(alone, full[0:300:13])  # alone vs among 299 others
        assert torch.equal(bgemm.bgemm(x[5:22], packed, 640, amx), full[5:22])  # another place in a block
        assert torch.equal(on_one_thread(lambda: bgemm.bgemm(x, packed, 640, amx)), full)


def test_linear_runs_on_it_and_under_compile():
    torch.manual_seed(2)
    w = (torch.randn(96, 64) * 0.1).bfloat16()
    lin = Linear(w, bf16_tiles=True)
    assert lin.layout.startswith("bgemm-tiled") and lin.weight is None
    x = torch.randn(5, 64).bfloat16()
    compiled = torch.compile(lambda t: lin(t) * 2, dynamic=False)
    assert torch.equal(compiled(x), lin(x) * 2)


def test_bad_input_is_refused():
    packed = bgemm.pack(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="K = 0"):  # once an uninitialised output: M was counted as 0 rows
        torch.ops.batchgen_bgemm.bgemm(torch.randn(5, 0).bfloat16(), bgemm.pack(torch.randn(32, 0).bfloat16()), 32, 0)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        torch.ops.batchgen_bgemm.bgemm(torch.randn(2, 64), packed, 32, 0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.batchgen_bgemm.bgemm(torch.randn(2, 96).bfloat16(), packed, 32, 0)


@pytest.mark.parametrize("i,k", [(1536, 576), (37, 64), (3, 5)])  # SmolLM2's MLP; I short of a block
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_swiglu_in_the_kernel_has_the_bits_of_the_matmul_then_the_activation(i, k, rows):
    """bgemm_swiglu (the gate/up matmul applying SwiGLU as it writes) against bgemm then the silumul
    kernel: the same bits on each instruction set, whatever the rows; the plain product from its tiles
    stays the matmul's."""
    from batchgen.model import activation

    if activation.load() is not None:
        pytest.skip(f"silumul kernel unavailable: {activation.load()}")
    g = torch.Generator().manual_seed(i + rows)
    w = (torch.randn(2 * i, k, generator=g) / k ** 0.5).bfloat16()
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    plain, fused = Linear(w.clone(), bf16_tiles=True), Linear(w.clone(), bf16_tiles=True)
    assert fused.fuse_swiglu() and fused.tiled is None and fused.layout.endswith("SwiGLU in the kernel")
    for amx in paths():
        plain.amx = fused.amx = amx
        want = activation.silu_mul(plain(x))
        got = fused.swiglu(x)
        assert got.shape == (rows, i) and got.dtype == torch.bfloat16 and torch.equal(got, want)
        assert torch.equal(fused.swiglu(x[-1:]), want[-1:])  # a row alone: its bits as in the batch
        assert torch.equal(fused(x), plain(x))
        assert torch.equal(on_one_thread(lambda: fused.swiglu(x)), want)
    # a bias keeps the matmul and the activation apart
    assert not Linear(w.clone(), torch.zeros(2 * i).bfloat16(), bf16_tiles=True).fuse_swiglu()


@pytest.mark.parametrize("n,k", [(576, 1536), (576, 576), (7, 33), (100, 1000)])  # SmolLM2's down, o; ragged
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_the_residual_add_in_the_kernel_has_the_bits_of_the_matmul_then_the_add(n, k, rows):
    """bgemm_add (h + x W^T as each tile leaves the kernel) against bgemm then ATen's bf16 add: the same
    bits on each instruction set, whatever the rows."""
    g = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    x, h = (torch.randn(rows, k, generator=g) * 3).bfloat16(), (torch.randn(rows, n, generator=g) * 10).bfloat16()
    lin = Linear(w.clone(), bf16_tiles=True)
    for amx in paths():
        lin.amx = amx
        want = h + lin(x)
        assert torch.equal(lin.add_to(x, h), want) and torch.equal(bgemm.add(x, lin.tiled, n, h, amx), want)
        assert torch.equal(lin.add_to(x[-1:], h[-1:]), want[-1:])  # a row alone: its bits as in the batch
        # a strided residual (made contiguous) and leading dimensions
        h3, x3 = torch.randn(2, rows, 2 * n, generator=g).bfloat16()[..., ::2], torch.randn(2, rows, k, generator=g).bfloat16()
        assert torch.equal(lin.add_to(x3, h3), h3 + lin(x3))
    with pytest.raises(RuntimeError, match="the residual must be bfloat16 of the output's shape"):
        bgemm.add(x, lin.tiled, n, h[:, :-1])
    with pytest.raises(RuntimeError, match="the residual must be bfloat16"):
        bgemm.add(x, lin.tiled, n, h.float())
    # a float32 residual beside bf16 weights: the add after the matmul, in ATen's type promotion
    assert torch.equal(lin.add_to(x, h.float()), h.float() + lin(x))


def test_fused_ops_run_under_compile():
    torch.manual_seed(3)
    gu = Linear((torch.randn(64, 32) * 0.1).bfloat16(), bf16_tiles=True)
    down = Linear((torch.randn(32, 32) * 0.1).bfloat16(), bf16_tiles=True)
    assert gu.fuse_swiglu()
    x, h = torch.randn(5, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    step = torch.compile(lambda t, r: down.add_to(gu.swiglu(t), r) * 2, dynamic=False)
    assert torch.equal(step(x, h), down.add_to(gu.swiglu(x), h) * 2)
