"""batchgen's float32 CPU matmul (batchgen/kernels/gemv.cpp): built on this machine, exact to float
rounding against torch's, inside a compiled step, and replaced by oneDNN's where it cannot be built."""

import os
import subprocess
import sys

import pytest
import torch

from batchgen import kernels
from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine.native import NativeEngine
from batchgen.model import gemv
from batchgen.model.linear import Linear, fp32_kernel

from conftest import engine_tokens

WIDTH = gemv.load()
needs_kernel = pytest.mark.needs(f"gemv kernel unavailable: {WIDTH}" if isinstance(WIDTH, str) else None,
                                 "BATCHGEN_REQUIRE_KERNELS")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # the kernel sums K products in its own order: float rounding, relative to the outputs' scale
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 4e-6 * want.abs().max().item() + 1e-6


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (7, 33), (49, 64), (200, 1), (100, 1000)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70])
def test_gemv_matches_torch_for_every_row_count_and_a_ragged_last_block(n, k, rows):
    g = torch.Generator().manual_seed(n * 1000 + rows)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    lin = Linear(w.clone(), b, gemv_width=WIDTH)
    assert lin.blocked is not None and lin.weight is None and lin.layout.startswith("gemv-blocked")
    _close(lin(x), x @ w.t() + b)
    # leading dimensions, and an input that is a strided view (the kernel makes it contiguous)
    x3 = torch.randn(2, rows, 2 * k, generator=g)[..., ::2]
    _close(lin(x3), x3 @ w.t() + b)


@needs_kernel
@pytest.mark.parametrize("i,k", [(1536, 576), (37, 64), (3, 5)])  # SmolLM2's MLP; I short of a block
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_swiglu_in_the_kernel_has_the_bits_of_the_matmul_then_the_activation(i, k, rows):
    """gemv_swiglu (the gate/up matmul applying SwiGLU as it writes) against gemv then the silumul
    kernel: the same bits, whatever the rows; the plain product from its blocks stays the matmul's."""
    from batchgen.model import activation

    if activation.load() is not None:
        pytest.skip(f"silumul kernel unavailable: {activation.load()}")
    g = torch.Generator().manual_seed(i + rows)
    w = torch.randn(2 * i, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g) * 3
    plain, fused = Linear(w.clone(), gemv_width=WIDTH), Linear(w.clone(), gemv_width=WIDTH)
    assert fused.fuse_swiglu() and fused.blocked is None and "SwiGLU" in fused.layout
    want = activation.silu_mul(plain(x))
    got = fused.swiglu(x)
    assert got.shape == (rows, i) and torch.equal(got, want)
    assert torch.equal(fused.swiglu(x[-1:]), want[-1:])  # a row alone: its bits as in the batch
    assert torch.equal(fused(x), plain(x))
    # a weight off the gemv kernel (or with a bias) keeps the matmul and the activation apart
    assert not Linear(w.clone(), torch.zeros(2 * i), gemv_width=WIDTH).fuse_swiglu()
    assert not Linear(w.clone(), gemv_width=None).fuse_swiglu()


@needs_kernel
@pytest.mark.parametrize("n,k", [(576, 1536), (576, 576), (7, 33), (100, 1000)])  # SmolLM2's down, o; ragged
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_the_residual_add_in_the_kernel_has_the_bits_of_the_matmul_then_the_add(n, k, rows):
    """gemv_add (h + x W^T, the add as each output tile leaves the registers) against gemv then h + y:
    the same bits, whatever the rows; weights off the gemv kernel add after the matmul."""
    g = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x, h = torch.randn(rows, k, generator=g) * 3, torch.randn(rows, n, generator=g) * 10
    lin = Linear(w.clone(), gemv_width=WIDTH)
    want = h + lin(x)
    got = lin.add_to(x, h)
    assert torch.equal(got, want) and torch.equal(gemv.add(x, lin.blocked, n, h), want)
    assert torch.equal(lin.add_to(x[-1:], h[-1:]), want[-1:])  # a row alone: its bits as in the batch
    # a strided residual and input (made contiguous), and leading dimensions
    h3, x3 = torch.randn(2, rows, 2 * n, generator=g)[..., ::2], torch.randn(2, rows, k, generator=g)
    assert torch.equal(lin.add_to(x3, h3), h3 + lin(x3))
    with pytest.raises(RuntimeError, match="the residual must be float32 of the output's shape"):
        gemv.add(x, lin.blocked, n, h[:, :-1])
    b = torch.randn(n, generator=g)  # a bias, or oneDNN's layout: the add after the matmul
    for other in (Linear(w.clone(), b, gemv_width=WIDTH), Linear(w.clone(), gemv_width=None)):
        assert torch.equal(other.add_to(x, h), h + other(x))


@needs_kernel
def test_gemv_runs_inside_a_compiled_function():
    """A compiled decode step calls the kernel as an opaque op (its fake gives Inductor the shape)."""
    w = torch.randn(100, 64)
    lin = Linear(w.clone(), gemv_width=WIDTH)

    def f(x):
        return torch.relu(lin(x * 2)) + 1

    x = torch.randn(3, 64)
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    _close(compiled(x), torch.relu((x * 2) @ w.t()) + 1)
    sq = Linear(torch.randn(64, 64), gemv_width=WIDTH)  # the residual add in the epilogue, traced too
    assert torch.equal(torch.compile(lambda x: sq.add_to(x * 2, x) - 1, fullgraph=True)(x), sq.add_to(x * 2, x) - 1)


@needs_kernel
def test_the_kernel_is_built_once_and_loaded_from_the_machine_cache():
    so = kernels.library_path("gemv", os.environ.get("CXX", "c++"))
    assert so.exists() and so.parent == kernels.kernel_dir()
    assert gemv.load() == WIDTH  # loaded once per process: no second build


def test_compiled_steps_are_cached_per_build_of_the_kernels(monkeypatch):
    """Inductor's on-disk cache is one folder per build of batchgen's kernels: a compiled step calls the
    ops by their schemas, and one cached before an op's arguments changed crashed the process (a
    segmentation fault) when it called the new build."""
    before = kernels.compile_cache_dir()
    assert before.parent == kernels.batchgen_home() / "inductor" and before == kernels.compile_cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(before)  # the tests' own cache (conftest) is the same
    real = kernels.source_text
    monkeypatch.setattr(kernels, "source_text", lambda n: real(n) + ("// changed" if n == "attention" else ""))
    assert kernels.compile_cache_dir() != before


@needs_kernel
def test_a_fresh_machine_builds_its_kernels_once(tmp_path):
    """`batchgen kernels build` (what set-up runs) from the sources, in a process of its own (one
    process loads a library once), into an empty kernel directory; a second run finds them there
    and builds nothing. Here for one kernel (`kernels build NAME...`: each build is the same path, and
    all seven cost over a minute); CI's set-up builds every one."""
    env = {**os.environ, "BATCHGEN_KERNEL_DIR": str(tmp_path)}
    wanted = ["gemv"]
    cmd = [sys.executable, "-m", "batchgen.cli", "kernels", "build", *wanted]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    built = sorted(tmp_path.glob("*.so"))
    names = {p.name.split("-")[0]: p for p in built}
    assert first.returncode == 0 and sorted(names) == sorted(wanted), first.stderr
    assert first.stdout.splitlines() == [f"{n}: ready, {names[n]}" for n in wanted]
    mtimes = [p.stat().st_mtime_ns for p in built]
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.stdout == first.stdout and [p.stat().st_mtime_ns for p in built] == mtimes
    assert sorted(tmp_path.iterdir()) == built  # no temporary file left beside them
    wrong = subprocess.run([*cmd[:-1], "gemv", "gemm"], env=env, capture_output=True, text=True, timeout=600)
    assert wrong.returncode == 2 and "no kernel named gemm (kernels: gemv, sample, qgemv" in wrong.stderr, wrong.stderr


def test_without_a_compiler_auto_falls_back_to_onednn_and_says_why(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("BATCHGEN_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    width, why = fp32_kernel("auto", "cpu")
    assert width is None and "no C++ compiler" in why
    with pytest.raises(RuntimeError, match="cannot be built here"):
        fp32_kernel("gemv", "cpu")
    e = NativeEngine(tiny_model_dir, EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=64, compile="off"))
    layout = e.conditions()["weight_layout"]
    assert layout.startswith("onednn-packed") and "gemv unavailable" in layout and "no C++ compiler" in layout
    e.add("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    while e.has_unfinished():
        e.step()


@needs_kernel
def test_gemv_and_onednn_give_the_same_greedy_tokens_on_the_real_model(real_model_dir):
    def run(kernel: str):
        out, cond = engine_tokens(real_model_dir, ["Name three rivers.", "What is 7 squared?", "Say hello in Spanish.",
                                                   "Why is the sky blue?"], SamplingParams(max_tokens=16, ignore_eos=True),
                                  dtype="float32", max_num_seqs=4, max_model_len=256, compile="off", fp32_kernel=kernel)
        return out, cond["weight_layout"]

    got, layout = run("gemv")
    ref, ref_layout = run("onednn")
    assert layout == f"gemv-blocked [N/{WIDTH}, K, {WIDTH}]" and ref_layout == "onednn-packed"
    assert got == ref


def test_the_choice_reaches_the_engine_from_the_run_settings():
    """The same field drives the CLI flag (--fp32-kernel), the flow parameter and the UI's form."""
    from pydantic import ValidationError

    from batchgen.settings import GenerateSettings

    cfg = GenerateSettings(input=["x.parquet"], fp32_kernel="onednn").to_run_config().engine_config
    assert cfg.fp32_kernel == "onednn"
    assert GenerateSettings(input=["x.parquet"]).to_run_config().engine_config.fp32_kernel == "auto"
    with pytest.raises(ValidationError):
        GenerateSettings(input=["x.parquet"], fp32_kernel="mkl")
