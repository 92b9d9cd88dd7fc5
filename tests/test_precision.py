"""`--dtype auto` and the lower-precision paths, against fp32 on the real model."""

import json

import pytest

from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine import precision
from batchgen.engine.native import NativeEngine
from conftest import skip_or_fail

PROMPTS = [f"Write a short story about a cat number {i}." for i in range(4)] + [
    "List three facts about the moon.", "Explain what a hash table is.", "Translate 'good morning' to French.",
    "What is 17 times 23?"]
# Greedy agreement with fp32 stated for this model: the share of output tokens generated before a
# row's first divergence. Measured on SmolLM2-135M-Instruct (2026-12-01, 8 prompts x 24 tokens): bf16
# 0.61 (8 mantissa bits: near-ties flip, and a flip changes the rest of the row), fp16 0.99.
MIN_AGREEMENT = {"bfloat16": 0.5, "float16": 0.9}
NEW_TOKENS = 24


def _greedy(model_dir, dtype: str) -> list[list[int]]:
    e = NativeEngine(model_dir, EngineConfig(dtype=dtype, max_num_seqs=8, max_model_len=256))
    for i, p in enumerate(PROMPTS):
        e.add(str(i), e.tokenizer.encode(p), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    out = {}
    while e.has_unfinished():
        for f in e.step().finished:
            out[f.request_id] = f.output_token_ids
    return [out[str(i)] for i in range(len(PROMPTS))]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens before each row's first divergence."""
    same = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += n
    return same / sum(len(x) for x in a)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lower_precision_agrees_with_fp32_greedy(real_model_dir, dtype):
    ref = _greedy(real_model_dir, "float32")
    got = _greedy(real_model_dir, dtype)
    share = agreement(ref, got)
    print(f"{dtype}: greedy agreement with fp32 {share:.2f}")
    assert share >= MIN_AGREEMENT[dtype]
    assert got[0][:4] == ref[0][:4]  # the first tokens of a plain prompt do not move


def test_auto_takes_the_fastest_measured_dtype_for_the_batch_band(tmp_path, monkeypatch):
    """A measured table (written where the cache lives) decides; another band can decide otherwise."""
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    from batchgen.metrics.probe import machine_key

    table = {"speeds": {"1": {"float32": 3.0, "bfloat16": 2.0, "float16": 1.0},
                        "8": {"float32": 3.0, "bfloat16": 1.0, "float16": 9.0},
                        "64": {"float32": 1.0, "bfloat16": 2.0, "float16": 9.0},
                        "256": {"float32": 1.0, "bfloat16": 2.0, "float16": 9.0}},
             "bytes_fp32": 1 << 20}
    (tmp_path / "probe").mkdir()
    name, _ = precision.record_name("cpu")  # float32's kernel here: gemv where it builds, else oneDNN
    (tmp_path / "probe" / f"{machine_key('cpu')}{name}.json").write_text(json.dumps(table))
    assert precision.resolve_dtype("auto", "cpu", 1)[0] == "float16"
    assert precision.resolve_dtype("auto", "cpu", 6)[0] == "bfloat16"
    dt, why = precision.resolve_dtype("auto", "cpu", 48)
    assert dt == "float32" and "band 64" in why and "cached" in why
    assert precision.resolve_dtype("bfloat16", "cpu", 48) == ("bfloat16", "as requested")


def test_auto_is_measured_once_and_recorded_in_the_conditions(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    calls = []
    real = precision.measure_dtype_speeds

    def counting(device, fp32_width=None):
        calls.append((device, fp32_width))
        return real(device, repeats=1, fp32_width=fp32_width)

    monkeypatch.setattr(precision, "measure_dtype_speeds", counting)
    e = NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=4, max_model_len=64, batch_invariant="off"))
    c = e.conditions()
    assert c["dtype"] in precision.CANDIDATES and c["dtype_choice"].startswith("auto: fastest at batch band 8")
    assert "measured in this run" in c["dtype_choice"]
    e2 = NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=4, max_model_len=64, batch_invariant="off"))
    assert "cached" in e2.conditions()["dtype_choice"] and calls == [("cpu", precision.record_name("cpu")[1])]
    # float32 timed on the kernel the engine runs it on; oneDNN's fp32 is a record of its own
    assert ("float32 on gemv" if calls[0][1] else "float32 on oneDNN") in c["dtype_choice"]
    e3 = NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=4, max_model_len=64, fp32_kernel="onednn", batch_invariant="off"))
    assert "float32 on oneDNN" in e3.conditions()["dtype_choice"]
    assert len(calls) == (2 if calls[0][1] else 1)


@pytest.mark.slow
def test_compiled_step_gives_the_eager_tokens(real_model_dir):
    def run(compile_):
        e = NativeEngine(real_model_dir, EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=128,
                                                      compile=compile_))
        for i, p in enumerate(PROMPTS[:4]):
            e.add(str(i), e.tokenizer.encode(p), SamplingParams(max_tokens=12, ignore_eos=True))
        out = {}
        while e.has_unfinished():
            out.update({f.request_id: f.output_token_ids for f in e.step().finished})
        return out, e.conditions()

    eager, c_off = run("off")
    compiled, c_on = run("on")
    assert c_off["compile"] == "off" and c_off["compile_s"] is None
    # on CPU the whole decode step is compiled per bucket (decode_graphs); fp32 stays the eager tokens
    assert c_on["compile"] == "whole decode step per bucket" and c_on["compile_s"] > 0
    assert compiled == eager


def test_gpu_check_runs_its_code_path_on_cpu_with_a_small_shape(tmp_path, monkeypatch):
    """The GPU check (batchgen.benchmarks.gpu), at a small shape on CPU: a random model built in place, every batch
    measured with its conditions (the figures themselves are never asserted)."""
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    from batchgen.benchmarks import gpu

    lines = []
    rows = gpu.run("small", "cpu", [1, 3], prompt_tokens=8, new_tokens=4, compile_="off", log=lines.append,
                   cuda_graphs="on")
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["cuda_graphs"].startswith("static buckets") for r in rows)  # the GPU's bucketing, less the capture
    assert all(r["tok_per_s"] > 0 and 0 < r["mbu"] and r["itl_p50_ms"] <= r["itl_p99_ms"] for r in rows)
    assert "shape small" in lines[0] and "probe peak read" in lines[0]
    assert all("tok/s" in l and "MBU" in l for l in lines[1:])


def test_fp32_kernel_auto_takes_the_faster_kernel_for_the_batch_band(tmp_path, monkeypatch):
    """The crossover is measured once per machine (gemv and oneDNN's kernel in turns at each band);
    a band then takes oneDNN's only where it is FP32_KERNEL_MARGIN faster. A table written where the
    cache lives decides the choice the same way."""
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    from batchgen.metrics.probe import machine_key
    from batchgen.model.linear import fp32_kernel

    assert precision.resolve_fp32_kernel("onednn", "cpu", 1) == ("onednn", "as requested")
    width, why = fp32_kernel("auto", "cpu")
    if width is None:  # no compiler here: oneDNN's, and the reason
        assert precision.resolve_fp32_kernel("auto", "cpu", 1) == ("onednn", f"gemv unavailable: {why}")
        return
    kernel, why = precision.resolve_fp32_kernel("auto", "cpu", 256)  # the real measurement
    assert "measured in this run" in why and "band 256" in why
    record = tmp_path / "probe" / f"{machine_key('cpu')}{precision.fp32_kernel_record(width)}.json"
    speeds = json.loads(record.read_text())["speeds"]
    assert set(speeds) == {"1", "8", "64", "256"} and all(set(v) == {"gemv", "onednn"} for v in speeds.values())
    assert kernel == ("onednn" if speeds["256"]["onednn"] * precision.FP32_KERNEL_MARGIN < speeds["256"]["gemv"]
                      else "gemv")
    table = {"speeds": {"1": {"gemv": 1.0, "onednn": 2.0}, "8": {"gemv": 1.0, "onednn": 0.99},
                        "64": {"gemv": 2.0, "onednn": 1.0}, "256": {"gemv": 2.0, "onednn": 1.0}},
             "bytes_fp32": 1 << 20}
    record.write_text(json.dumps(table))
    assert precision.resolve_fp32_kernel("auto", "cpu", 1)[0] == "gemv"
    assert precision.resolve_fp32_kernel("auto", "cpu", 8)[0] == "gemv"  # 1% faster: within the margin
    kernel, why = precision.resolve_fp32_kernel("auto", "cpu", 48)
    assert kernel == "onednn" and "band 64" in why and "cached" in why


def test_the_engine_runs_float32_on_the_kernel_auto_takes_for_its_band(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    from batchgen.metrics.probe import machine_key
    from batchgen.model.linear import fp32_kernel

    width, _ = fp32_kernel("auto", "cpu")
    if width is None:
        skip_or_fail("no gemv kernel here (the fallback is tested in test_gemv)")
    from batchgen.model.loader import read_model_config

    (tmp_path / "probe").mkdir()
    shapes = precision.decode_matrices(read_model_config(tiny_model_dir))  # the crossover is per model shape
    (tmp_path / "probe" / f"{machine_key('cpu')}{precision.fp32_kernel_record(width, shapes)}.json").write_text(json.dumps(
        {"speeds": {"1": {"gemv": 1.0, "onednn": 2.0}, "8": {"gemv": 1.0, "onednn": 2.0},
                    "64": {"gemv": 2.0, "onednn": 1.0}, "256": {"gemv": 2.0, "onednn": 1.0}}, "bytes_fp32": 1 << 20}))

    def layout(max_num_seqs, kernel="auto"):
        e = NativeEngine(tiny_model_dir, EngineConfig(dtype="float32", max_num_seqs=max_num_seqs, max_model_len=64,
                                                      fp32_kernel=kernel, batch_invariant="off"))
        return e.conditions()["weight_layout"]

    assert layout(2).startswith("gemv") and "auto: gemv at batch band 1" in layout(2)
    assert layout(64).startswith("onednn-packed") and "auto: onednn at batch band 64" in layout(64)
    assert layout(64, "gemv").startswith("gemv") and "auto" not in layout(64, "gemv")


def test_the_crossover_is_timed_on_the_models_own_matrices(real_model_dir):
    """A step's matrices, scaled to MEASURE_CAP_BYTES: whole layers and the head cut by one share."""
    from batchgen.model.loader import read_model_config

    c = read_model_config(real_model_dir)  # SmolLM2-135M: 30 layers, 49152 x 576 head, 538 MB at fp32
    shapes = precision.decode_matrices(c)
    layer = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    assert shapes[:4] == layer and len(shapes) % 4 == 1 and shapes[-1][1] == 576
    share = (len(shapes) // 4) / c.num_layers
    assert shapes[-1][0] == pytest.approx(c.vocab_size * share, rel=0.05)
    assert 0.9 * precision.MEASURE_CAP_BYTES <= sum(4 * n * k for n, k in shapes) <= 1.02 * precision.MEASURE_CAP_BYTES
    assert precision.fp32_kernel_record(24, shapes) != precision.fp32_kernel_record(24)
