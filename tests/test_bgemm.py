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
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        torch.ops.batchgen_bgemm.bgemm(torch.randn(2, 64), packed, 32, 0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.batchgen_bgemm.bgemm(torch.randn(2, 96).bfloat16(), packed, 32, 0)
