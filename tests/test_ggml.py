"""batchgen's low-bit kernel (batchgen/kernels/qgemv.cpp) on GGUF's Q4_1 and Q8_0 blocks: the shipped
blocks are the model's exact weights, every instruction set this CPU runs gives float32's product of
them, a row's result does not depend on its batch, and the engine runs the model on them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchgen.config import EngineConfig, SamplingParams
from batchgen.model import ggml
from batchgen.model.ggml import BlockLinear

from conftest import engine_tokens, on_one_thread, skip_or_fail

CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
        "Explain photosynthesis in one sentence."]


@pytest.fixture(scope="module")
def isas() -> list[int]:
    """The instruction sets this CPU runs, best first (the portable build runs everywhere)."""
    best = ggml.load()
    if isinstance(best, str):
        skip_or_fail(f"qgemv kernel unavailable: {best}")
    return [i for i in (512, 2, 1) if i <= best]


def random_blocks(kind: str, n: int, k: int, seed: int) -> BlockLinear:
    g = torch.Generator().manual_seed(seed)
    kb = k // ggml.QK
    d = (torch.rand(n, kb, generator=g) * 0.02 + 1e-3).half()
    if kind == "Q4_1":
        qs = torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)
        return BlockLinear(kind, qs, d, (torch.randn(n, kb, generator=g) * 0.05).half())
    return BlockLinear(kind, torch.randint(-128, 128, (n, kb, 32), generator=g, dtype=torch.int8), d, None)


def reference(lin: BlockLinear, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ lin.dequantize().double().t()).float()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 sums of K products in the kernel's order against float64's: rounding, relative to the scale
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 2e-6 * want.abs().max().item() + 1e-6


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(960, 576), (13, 64), (8, 32), (100, 1536)])
def test_every_instruction_set_multiplies_the_blocks_exactly(isas, kind, n, k):
    """Row counts that take every tile (lone rows by column groups, QR rows a column, the rest), a
    ragged last group of columns, leading dimensions and a strided input."""
    lin = random_blocks(kind, n, k, seed=n + k)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 3, 5, 8, 9, 70):
        x = torch.randn(rows, k, generator=g)
        want = reference(lin, x)
        for isa in isas:
            lin.isa = isa
            close(lin(x), want)
    x3 = torch.randn(2, 3, 2 * k, generator=g)[..., ::2]
    close(lin(x3), reference(lin, x3))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(isas, kind):
    """Bit for bit: a row alone, among 7 or among 64 rows, on one thread or two."""
    lin = random_blocks(kind, 200, 576, seed=3)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(5))
    for isa in isas:
        lin.isa = isa
        full = lin(x)
        assert torch.equal(full, on_one_thread(lambda: lin(x)))
        for i in (0, 6, 63):
            assert torch.equal(lin(x[i:i + 1])[0], full[i])
            assert torch.equal(lin(x[max(0, i - 6):i + 1])[-1], full[i])


def test_q4_1_gives_the_same_bits_on_avx2_as_on_avx512(isas):
    """Both run a block as d (q . x) + m (sum of x) with the same operations in the same order per row
    and column, 16 lanes or 8 a vector: a job's Q4_1 products do not depend on which of the two CPUs
    it ran on (activations in float32's normal range, as a model's are)."""
    if 512 not in isas:
        pytest.skip("this CPU does not run AVX-512")
    lin = random_blocks("Q4_1", 100, 1536, seed=7)
    for rows in (1, 2, 5, 64):
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
        lin.isa = 512
        wide = lin(x)
        lin.isa = 2
        assert torch.equal(lin(x), wide)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_swiglu_and_the_residual_add_in_the_kernel_have_the_bits_of_the_ops_in_turn(isas, kind):
    """swiglu: silu(x Wg^T) * (x Wu^T) from one call, each task running a group of gate columns and the
    same up columns; add: h + x W^T, the add as each tile leaves the kernel. At the instruction set the
    engine runs (the best here), bit for bit the matmul then the silumul kernel (both built for the same
    instructions: vec.h's SiLU), or the matmul then h + y; the portable build, which the silumul kernel
    is not built for, to float32's rounding. Lone rows, panels, a chunk of rows, strided input."""
    from batchgen.model import activation

    if activation.load() is not None:
        skip_or_fail(f"silumul kernel unavailable: {activation.load()}")
    gate_up, down = random_blocks(kind, 2 * 48, 576, seed=11), random_blocks(kind, 100, 1536, seed=12)
    assert gate_up.fuse_swiglu() and gate_up.gated and not random_blocks(kind, 2 * 44, 64, seed=1).fuse_swiglu()
    g = torch.Generator().manual_seed(13)
    for rows in (1, 2, 3, 5, 70):
        x, a, h = torch.randn(rows, 576, generator=g), torch.randn(rows, 1536, generator=g), torch.randn(rows, 100, generator=g)
        for isa in isas:
            gate_up.isa = down.isa = isa
            fused, apart = gate_up.swiglu(x), torch.ops.batchgen_act.silu_mul(gate_up(x))
            added = down.add_to(a, h)
            assert fused.shape == (rows, 48) and torch.equal(added, h + down(a))
            if isa == isas[0]:
                assert torch.equal(fused, apart)
            else:
                torch.testing.assert_close(fused, apart, rtol=1e-6, atol=1e-6)
    x3 = torch.randn(2, 3, 2 * 576, generator=g)[..., ::2]
    gate_up.isa = isas[0]
    assert torch.equal(gate_up.swiglu(x3), torch.ops.batchgen_act.silu_mul(gate_up(x3)))
    with pytest.raises(RuntimeError, match="the residual must be float32"):
        down.add_to(a, h[:, :99])
    odd = random_blocks("Q4_1", 2 * 44, 576, seed=1)  # halves of 44 rows: not whole groups of 8
    with pytest.raises(RuntimeError, match="whole groups"):
        torch.ops.batchgen_qgemv.swiglu(x, odd.qs, odd.d, odd.m, 2 * 44, 0)


CAPPED = """
import json, sys, torch
from batchgen import kernels
from batchgen.metrics.conditions import cpu_features
from batchgen.model import ggml
sys.path.insert(0, sys.argv[1])
from test_ggml import random_blocks
isa = ggml.load()
lin = random_blocks("Q4_1", 100, 1536, seed=7)
x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(5))
torch.save(lin(x), sys.argv[2])
from batchgen.config import cap_cpu_libraries
libs = cap_cpu_libraries()  # as the CLI does first thing
print(json.dumps([isa, kernels.load("gemv"), kernels.load("bgemm"), kernels._command("gemv", "c++", "x"),
                  cpu_features(), libs]))
"""


def test_aten_cpu_capability_caps_batchgens_kernels_too(isas, tmp_path):
    """ATEN_CPU_CAPABILITY=avx2, PyTorch's own cap (ATen's kernels, Inductor's code), caps batchgen's
    kernels as well, and the CLI passes it on to oneDNN and MKL, so one variable runs a process as an
    AVX2 CPU would: qgemv picks its AVX2 build (same bits as here), the -march kernels build for
    x86-64-v3, bgemm (AVX512_BF16) is not there, and the run's conditions say so."""
    if 2 not in isas:
        pytest.skip("this CPU does not run AVX2")
    out = tmp_path / "y.pt"
    r = subprocess.run([sys.executable, "-c", CAPPED, str(Path(__file__).parent), str(out)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})
    assert r.returncode == 0, r.stderr[-2000:]
    isa, gemv_why, bgemm_why, command, features, libs = json.loads(r.stdout.splitlines()[-1])
    assert isa == 2 and gemv_why is None and "-march=x86-64-v3" in command
    assert "AVX512_BF16" in bgemm_why  # its build refuses a CPU (class) without bf16 dot products
    # ... and oneDNN and MKL get the cap too (their own variables, read at their first use)
    assert libs == {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert features.endswith("; capped to avx2 (ATEN_CPU_CAPABILITY); ONEDNN_MAX_CPU_ISA=AVX2; "
                             "MKL_ENABLE_INSTRUCTIONS=AVX2")
    lin = random_blocks("Q4_1", 100, 1536, seed=7)
    lin.isa = 2
    assert torch.equal(torch.load(out), lin(torch.randn(5, 1536, generator=torch.Generator().manual_seed(5))))
    r = subprocess.run([sys.executable, "-c", "from batchgen.config import cpu_capability; cpu_capability()"],
                       capture_output=True, text=True, env={**os.environ, "ATEN_CPU_CAPABILITY": "avx3"})
    assert r.returncode != 0 and "ATEN_CPU_CAPABILITY='avx3': batchgen knows default, avx2, avx512" in r.stderr


def test_bad_shapes_and_instruction_sets_are_refused(isas):
    lin = random_blocks("Q4_1", 16, 64, seed=1)
    with pytest.raises(RuntimeError, match="is not the weight's K"):
        lin(torch.randn(2, 63))
    with pytest.raises(RuntimeError, match="float32"):
        lin(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="isa must be"):
        torch.ops.batchgen_qgemv.q4_1(torch.randn(1, 64), lin.qs, lin.d, lin.m, 16, 3)
    if 512 not in isas:
        with pytest.raises(RuntimeError, match="does not run isa 512"):
            torch.ops.batchgen_qgemv.q4_1(torch.randn(1, 64), lin.qs, lin.d, lin.m, 16, 512)


def test_the_kernel_runs_inside_a_compiled_function(isas):
    """A compiled decode step calls it as an opaque op (its fake gives Inductor the shape)."""
    lin = random_blocks("Q4_1", 20, 64, seed=2)

    def f(x):
        return torch.relu(lin(x * 2)) + 1

    x = torch.randn(3, 64)
    got = torch.compile(f, fullgraph=True, dynamic=False)(x)
    close(got, torch.relu(reference(lin, x * 2)) + 1)
    # and its epilogues (their fakes give the SwiGLU half and the residual's shape)
    gate_up = random_blocks("Q4_1", 32, 64, seed=4)
    assert gate_up.fuse_swiglu()
    h = torch.randn(3, 20)
    got = torch.compile(lambda x: lin.add_to(gate_up.swiglu(x).repeat(1, 4), h) * 2, fullgraph=True, dynamic=False)(x)
    assert torch.equal(got, lin.add_to(gate_up.swiglu(x).repeat(1, 4), h) * 2)


def test_the_shipped_blocks_are_the_models_weights_exactly(isas, real_model_dir):
    """The GGUF's Q4_1 layers and Q8_0 embedding, unpermuted from llama.cpp's RoPE row order, equal
    the weights `model prepare` dequantized into safetensors (transformers' GGUF reader), bit for bit."""
    from batchgen.model.loader import load_state_dict, read_model_config

    c = read_model_config(real_model_dir)
    state = load_state_dict(real_model_dir)
    blocks = ggml.GGUFBlocks(ggml.find_gguf(real_model_dir), c.num_heads, c.num_kv_heads)
    names = [f"model.layers.{i}.{m}.weight" for i in (0, c.num_layers - 1) for m in ggml.LAYER_NAMES.values()]
    for name in names + ["model.embed_tokens.weight"]:
        lin = blocks.linear(name)
        assert lin.kind == ("Q8_0" if "embed" in name else "Q4_1")
        assert torch.equal(lin.dequantize(), state[name].float()), name
    # a Q4_1 row stores 16 bytes of nibbles, 2 of d and 2 of m per 32 weights: 0.625 bytes a weight
    assert blocks.linear(names[0]).nbytes == np.prod(state[names[0]].shape) * 20 // 32


def test_gguf_needs_float32_activations_and_a_gguf_file(tmp_path, tiny_model_dir):
    from batchgen.engine.native import NativeEngine
    from batchgen.model.loader import ModelLoadError

    with pytest.raises(ValueError, match="float32 activations"):
        EngineConfig(quantization="gguf", dtype="bfloat16")
    with pytest.raises(ModelLoadError, match="has none"):
        NativeEngine(tiny_model_dir, EngineConfig(quantization="gguf", max_num_seqs=2, max_model_len=64))


@pytest.mark.slow
def test_the_engine_on_the_shipped_blocks_matches_float32(isas, real_model_dir):
    """Greedy tokens on the GGUF's own blocks against the float32 model (the same weights, dequantized):
    only float rounding differs, so the tokens agree (measured: 4 of 4 rows identical over 64 tokens;
    the stated floor is 0.9 of the tokens before each row's first divergence)."""
    from batchgen.benchmarks.bench_results import agreement

    def run(**kw):
        out, cond = engine_tokens(real_model_dir, CHAT, SamplingParams(max_tokens=24, ignore_eos=True),
                                  max_num_seqs=4, max_model_len=256, kv_cache_tokens=2048, **kw)
        return [out[str(i)] for i in range(len(CHAT))], cond

    ref, _ = run(dtype="float32", compile="off")
    got, cond = run(quantization="gguf", compile="off")
    assert cond["dtype"] == "float32" and cond["quantization"].startswith("gguf blocks as shipped (Q4_1, Q8_0)")
    assert ggml.ISA_NAMES[isas[0]] in cond["quantization"] and "Q4_1 blocks" in cond["weight_layout"]
    assert cond["weight_bytes"] < 110e6  # about 96 MB read a step, against float32's 540
    assert agreement(ref, got) >= 0.9, agreement(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("invariant", ["on", "off"])
def test_dtype_auto_takes_the_shipped_blocks_where_they_measure_faster(isas, real_model_dir, tmp_path, monkeypatch,
                                                                       invariant):
    """`--dtype auto` on CPU weighs the model's own GGUF blocks against the dense dtype it would take:
    with batch invariance off, at the band of max_num_seqs (here, by the measurement's test double,
    the blocks at band 1 and not at 64), with the same greedy tokens as float32 (they are the model's
    exact weights); batch-invariant, at one band whatever max_num_seqs, so every batch size takes the
    same weights."""
    from batchgen import kernels
    from batchgen.engine import precision

    monkeypatch.setenv("BATCHGEN_KERNEL_DIR", str(kernels.kernel_dir()))  # the built kernels stay found
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))  # no cached choice: the doubles below decide
    dense = {str(b): {"float32": 1.0, "bfloat16": 2.0, "float16": 3.0} for b in precision.BANDS}
    monkeypatch.setattr(precision, "measure_dtype_speeds", lambda device, fp32_width=None: {
        "speeds": dense, "bytes_fp32": 1 << 20})
    calls = []

    def measure_gguf_double(device, shapes, dtype, fp32_width, repeats=3, bf16_tiles=False):  # double: gguf wins at 1, 8
        calls.append((dtype, len(shapes)))
        return {"speeds": {str(b): {"gguf": 0.5 if b < 64 else 2.0, dtype: 1.0} for b in precision.BANDS},
                "matrices": len(shapes)}

    monkeypatch.setattr(precision, "measure_gguf", measure_gguf_double)
    monkeypatch.setattr(precision, "measure_invariant", lambda device, shapes, fp32_width, repeats=3: {
        "speeds": dense, "matrices": len(shapes)})  # double: float32 on gemv the invariant dense choice

    def run(max_num_seqs, **kw):
        out, cond = engine_tokens(real_model_dir, CHAT, SamplingParams(max_tokens=16, ignore_eos=True),
                                  max_num_seqs=max_num_seqs, max_model_len=256, kv_cache_tokens=2048,
                                  compile="off", batch_invariant=invariant, **kw)
        return [out[str(i)] for i in range(len(CHAT))], cond

    got, cond = run(1)
    if invariant == "on":  # weighed at the band of INVARIANT_BATCH (64) whatever max_num_seqs: never here
        _, wide = run(64)
        for c in (cond, wide):
            assert c["plan"]["weights"] == "dense" and c["plan"]["batch_invariant"], c["plan"]
            assert "band 64" in c["dtype_choice"] and "GGUF blocks not taken" in c["dtype_choice"]
        return
    assert cond["plan"]["weights"] == "gguf" and cond["plan"]["matmul"] == "qgemv" and cond["dtype"] == "float32"
    assert cond["quantization"].startswith("gguf blocks as shipped")
    assert "auto: the model's GGUF blocks" in cond["dtype_choice"] and "band 1" in cond["dtype_choice"]
    ref, _ = run(1, dtype="float32")
    assert got == ref
    _, wide = run(64)
    assert wide["quantization"] is None and "GGUF blocks not taken" in wide["dtype_choice"]
    assert calls and all(c == calls[0] for c in calls) and calls[0][0] == "float32"
    assert not cond["plan"]["batch_invariant"] and cond["batch_invariant"].startswith("off: as asked")
