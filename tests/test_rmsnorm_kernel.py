"""batchgen's fixed-order RMSNorm (batchgen/kernels/rmsnorm.cpp) against torch's (batchgen.model.llama.
rms_norm, the HF reference's arithmetic), then what it is for: a row comes out in the same bits alone
or in any batch, on any number of threads, and in a compiled function as in an eager call (Inductor's
own fused norm adds a row's squares in another order than ATen's `mean`, which made bf16 rows' tokens
depend on their batch). The engine side is in test_batch_invariance."""

import pytest
import torch

from batchgen.model import rmsnorm
from batchgen.model.llama import rms_norm
from conftest import kernel_op, on_one_thread


@pytest.fixture(scope="module")
def op():
    return kernel_op("rmsnorm", rmsnorm.load(), rmsnorm.rms_norm)


def rows(n_rows, width, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n_rows, width, generator=gen) * 3).to(dtype)
    w = (torch.randn(width, generator=gen) * 0.2 + 1).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [576, 77, 8])  # SmolLM2's hidden size; widths short of and past 16 sums
def test_matches_torch_norm(op, dtype, width):
    x, w = rows(40, width, dtype)
    got, ref = op(x, w, 1e-5), rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # float32 inside: only the order of adding differs, so results agree to the dtype's last bit or so
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # at bf16's rounding the two agree on nearly every element
        assert (got != ref).float().mean().item() < 0.01


def test_heads_and_strided_rows(op):
    """Qwen3's per-head q/k norm: [T, H, D] rows, taken from a wider tensor (not contiguous)."""
    x, w = rows(6, 3 * 64 + 32, torch.float32)
    q = x[:, :192].unflatten(-1, (3, 64))
    assert not q.is_contiguous()
    torch.testing.assert_close(op(q, w[:64].contiguous(), 1e-6), rms_norm(q, w[:64], 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_in_a_batch_and_on_any_threads(op, dtype):
    x, w = rows(300, 576, dtype, seed=3)
    full = op(x, w, 1e-5)
    for i in (0, 7, 150, 299):
        assert torch.equal(op(x[i:i + 1], w, 1e-5), full[i:i + 1])
        assert torch.equal(op(x[i:i + 33], w, 1e-5)[0], full[i])  # first of a batch of 33 (or fewer at the end)
    assert torch.equal(on_one_thread(lambda: op(x, w, 1e-5)), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_and_eager_give_the_same_bits(op, dtype):
    """The defect it fixes: torch's norm compiled and eager differ (with torch 2.13 on 4,096 rows like
    these: about 1,330 rows in float32, 2-5 in bfloat16, measured); the kernel in a compiled function
    (an opaque op, traced through its shape-only kernel) gives the eager bits."""
    x, w = rows(4096, 576, dtype, seed=5)

    def step(h, weight):  # a residual add around the norm, as the model's step has
        return op(h + 1, weight, 1e-5) * 2

    compiled = torch.compile(step, dynamic=True, options={"emulate_precision_casts": True})
    assert torch.equal(compiled(x, w), step(x, w))
    assert torch.equal(compiled(x[:3], w), step(x, w)[:3])


def test_bad_input_is_refused_clearly(op):
    x, w = rows(2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(x, w.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight \[16\] expected"):
        op(x, w[:8], 1e-5)
