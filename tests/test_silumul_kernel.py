"""batchgen's one-pass SwiGLU activation (batchgen/kernels/silumul.cpp) against torch's ops
(batchgen.model.llama.silu_mul), then what it must keep: an element's bits depend on its own gate and
up alone (alone or in a batch, on any threads, a tail past the vector width as a full vector), and a
compiled function calls the same op as an eager call. The engine side is in test_batch_invariance."""

import pytest
import torch

from batchgen.model import activation
from batchgen.model.llama import silu_mul
from conftest import kernel_op, on_one_thread


@pytest.fixture(scope="module")
def op():
    return kernel_op("silumul", activation.load(), activation.silu_mul)


def gate_up(n_rows, width, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_rows, 2 * width, generator=gen) * 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1536, 37, 3])  # SmolLM2's intermediate size; tails short of a vector
def test_matches_torch_ops(op, dtype, width):
    x = gate_up(50, width, dtype)
    got, ref = op(x), silu_mul(x)
    assert got.dtype == dtype and got.shape == (50, width)
    # its own e^x (~2e-7 relative) for ATen's: agreement to the dtype's last bit or so
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype != torch.float32:  # rounded where ATen rounds: at 16 bits nearly every element is the same
        assert (got != ref).float().mean().item() < 0.01


def test_extremes_do_not_overflow(op):
    x = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    got = op(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, silu_mul(x), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_in_a_batch_on_any_threads_and_compiled(op, dtype):
    x = gate_up(300, 1536 + 5, dtype, seed=3)
    batch = op(x)
    assert torch.equal(batch, on_one_thread(lambda: op(x)))
    for r in (0, 17, 299):
        assert torch.equal(op(x[r:r + 1])[0], batch[r])
    compiled = torch.compile(lambda t: op(t) * 1, dynamic=False)  # opaque to Inductor: the same op runs
    assert torch.equal(compiled(x[:7]), batch[:7])


def test_bad_input_is_refused(op):
    with pytest.raises(RuntimeError, match="last dim must be even"):
        op(torch.zeros(2, 7))
