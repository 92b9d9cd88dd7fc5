"""The decode step in static buckets (what CUDA graphs replay on GPU, and what Inductor compiles
whole on CPU): padding rows and pairs must never change a token. On CPU the same padded,
static-buffer step runs eagerly or compiled (there are no CUDA graphs to capture here); the capture
itself runs only on CUDA."""

import pytest
import torch

from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine import decode_graphs
from batchgen.engine.decode_graphs import bucket, row_bucket
from batchgen.engine.native import NativeEngine

from test_engine import run_all


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]


def test_row_buckets_are_powers_of_two_then_multiples_of_eight():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 33, 64, 65)] == [1, 2, 4, 8, 8, 16, 16, 40, 64, 72]


def record_cheap_compiles(model_dir, **cfg) -> None:
    """Put a cheap compile cost on this machine's record for the model as an engine of `cfg` loads it
    (the record is per model shape, dtype and weight layout), so that --compile auto compiles at once."""
    e = NativeEngine(model_dir, EngineConfig(compile="off", **cfg))
    decode_graphs._record_compile_s("cpu", decode_graphs._compile_record(e.model), 1e-4)


def generate(model_dir, cuda_graphs, dtype="float32", compile="off", **cfg):
    e = NativeEngine(model_dir, EngineConfig(max_num_seqs=6, max_model_len=160, dtype=dtype, compile=compile,
                                             cuda_graphs=cuda_graphs, block_size=4, **cfg))
    # rows of different lengths and budgets: the batch shrinks as they finish (6, 5, ... 1 rows), so
    # most steps pad rows; contexts of 11 to 117 positions span one or two 64-position key tiles, so
    # the pair count is rarely a power of two and most steps pad pairs too
    for i in range(6):
        greedy = i % 2 == 0
        e.add(f"r{i}", list(range(20 + i, 31 + 16 * i)),
              SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True, temperature=0.0 if greedy else 0.8,
                             top_p=1.0 if greedy else 0.9, seed=i))
    steps, done = run_all(e)
    e.steps_seen = steps
    return {k: f.output_token_ids for k, f in done.items()}, e


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_buckets_give_the_same_tokens(tiny_model_dir, dtype):
    ref, off = generate(tiny_model_dir, "off", dtype)
    got, on = generate(tiny_model_dir, "on", dtype)
    assert off.runner.graphs is None and off.conditions()["cuda_graphs"] == "off"
    g = on.runner.graphs
    assert g is not None and g.num_steps > 10 and len(g.buckets) >= 3  # several (rows, pairs) buckets used
    assert {rows for rows, _ in g.buckets} >= {8, 4, 1} and any(pairs > rows for rows, pairs in g.buckets)
    assert got == ref
    assert on.conditions()["cuda_graphs"].startswith("static buckets, eager")
    # the scratch block is outside the allocator's pool: padding never touches a request's blocks
    assert on.runner.kv.num_blocks == on.blocks.num_blocks + 1


def test_static_buckets_with_prefix_caching_and_preemption(tiny_model_dir):
    """A pool too small for every row: requests are preempted and recomputed; tokens still match."""
    ref, _ = generate(tiny_model_dir, "off", kv_cache_tokens=144)
    got, on = generate(tiny_model_dir, "on", kv_cache_tokens=144)
    assert got == ref and on.runner.graphs.num_steps > 0
    assert sum(s.num_preempted for s in on.steps_seen) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_decode_step_gives_the_eager_tokens(tiny_model_dir, dtype, tmp_path, monkeypatch):
    """--compile on (CPU): Inductor compiles the whole padded decode step once per bucket, the
    prepacked matmuls called as opaque kernels; the tokens are those of the eager unpadded path."""
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    ref, off = generate(tiny_model_dir, "off", dtype, compile="off")
    got, on = generate(tiny_model_dir, "auto", dtype, compile="on")
    assert off.runner.graphs is None and off.conditions()["compile"] == "off"
    g = on.runner.graphs
    assert g.mode == "compile" and g.num_steps > 10 and len(g.buckets) >= 3 and all(
        st.compiled for st in g.buckets.values())
    if dtype == "float32":
        assert got == ref
    else:  # Inductor rounds a bf16 chain of elementwise ops once (computed in fp32), eager after each op:
        # the random tiny model's near-flat distributions then sample differently; greedy rows must agree
        assert {k: v for k, v in got.items() if int(k[1:]) % 2 == 0} == {
            k: v for k, v in ref.items() if int(k[1:]) % 2 == 0}
    c = on.conditions()
    assert c["compile"] == "whole decode step per bucket" and c["compile_s"] == g.compile_s > 0
    # rows and pairs are dynamic sizes: one compile for 1 row, one for every bucket of 2 rows or more
    assert {B for B, _ in g.buckets} >= {8, 4, 2, 1} and g.num_compiles == 2 and g.dynamic_rows
    assert ("compiled per 1 row and once for 2 rows or more (rows and pairs dynamic sizes) on a bucket's first use"
            in c["cuda_graphs"])
    # the compile cost is recorded for this machine and model: what --compile auto rents against next time
    assert decode_graphs._estimated_compile_s("cpu", g.record) > 0


def one_long_row(model_dir, compile="on", attention_backend="auto", **graphs):
    """One greedy row whose context grows from 20 to 300 positions: 1 to 5 pairs of 64 keys, so its
    steps pass through pairs buckets 2, 4 and 8 (and 1, with the pairs as a static size)."""
    e = NativeEngine(model_dir, EngineConfig(max_num_seqs=1, max_model_len=320, compile=compile,
                                             cuda_graphs="off" if compile == "off" else "auto", block_size=4,
                                             attention_backend=attention_backend))
    for name, value in graphs.items():
        setattr(e.runner.graphs, name, value)
    e.add("r", list(range(20, 40)), SamplingParams(max_tokens=280, ignore_eos=True))
    _, done = run_all(e)
    return done["r"].output_token_ids, e


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_the_pairs_are_a_dynamic_size_so_a_rows_bucket_compiles_once(tiny_model_dir, backend, tmp_path, monkeypatch):
    """The number of (query tile, key tile) pairs grows with the context (one per 64 keys at batch 1). As
    a static size, each new pairs bucket compiled the whole step again (a batch-1 job of 600 tokens
    compiled 5 times, 81 s on SmolLM2-135M). As a dynamic one, a rows bucket compiles once and serves
    every pairs bucket, with the eager step's tokens; only a real compile is counted (and recorded for
    --compile auto). Both CPU attention backends: batchgen's kernel (opaque to Inductor) and the PyTorch
    path, whose gathers Inductor compiles with the pairs as a symbolic size."""
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    ref, _ = one_long_row(tiny_model_dir, compile="off", attention_backend=backend)
    got, e = one_long_row(tiny_model_dir, attention_backend=backend)
    g = e.runner.graphs
    assert got == ref and g.dynamic_pairs and {P for _, P in g.buckets} == {2, 4, 8}
    assert g.num_compiles == 1 and g.compiled_rows == {1} and g.compile_s > 0
    assert all(st.compiled for st in g.buckets.values()) and "1 compiled so far" in e.conditions()["cuda_graphs"]


def test_static_pairs_compile_once_per_pairs_bucket(tiny_model_dir, tmp_path, monkeypatch):
    """The static sizes (the step A/B benchmark's contrast), on the PyTorch backend: one compile per
    pairs bucket, the eager step's tokens."""
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    ref, _ = one_long_row(tiny_model_dir, compile="off", attention_backend="torch")
    static, e = one_long_row(tiny_model_dir, attention_backend="torch", dynamic_pairs=False)
    g = e.runner.graphs
    assert static == ref and {P for _, P in g.buckets} == {1, 2, 4, 8} and g.num_compiles == 4


def test_two_engines_in_one_process_never_share_a_compiled_bucket(tiny_model_dir, tmp_path, monkeypatch):
    """A compiled bucket checks only the guards on its own buffers (bucket_guards), so each engine
    compiles a code object of its own (own_code): a float32 engine's buckets, compiled first, must not
    serve a bfloat16 engine's identical shapes (they would read its bf16 weights as float32)."""
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    _, first = generate(tiny_model_dir, "auto", "float32", compile="on")
    ref, _ = generate(tiny_model_dir, "off", "bfloat16", compile="off")
    got, second = generate(tiny_model_dir, "auto", "bfloat16", compile="on")
    a, b = first.runner.graphs.compiled_step, second.runner.graphs.compiled_step
    assert a._torchdynamo_orig_callable.__code__ is not b._torchdynamo_orig_callable.__code__
    assert set(first.runner.graphs.buckets) & set(second.runner.graphs.buckets)  # the same shapes, compiled twice
    assert all(st.compiled for st in second.runner.graphs.buckets.values())
    assert {k: v for k, v in got.items() if int(k[1:]) % 2 == 0} == {k: v for k, v in ref.items() if int(k[1:]) % 2 == 0}


def test_auto_compile_runs_eager_until_a_bucket_has_paid_for_its_compile(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    ref, _ = generate(tiny_model_dir, "off", compile="off")
    # nothing measured on this machine yet: a compile is assumed to cost UNMEASURED_COMPILE_S, so a
    # short job never pays for one and every step runs the unpadded eager path
    got, e = generate(tiny_model_dir, "auto", compile="auto")
    g = e.runner.graphs
    assert got == ref and g.mode == "compile" and g.auto
    assert g.compile_after_s == decode_graphs.UNMEASURED_COMPILE_S / decode_graphs.SAVING
    assert not g.buckets and g.num_steps == 0 and sum(g.eager_s.values()) > 0 and g.compile_s == 0
    assert e.conditions()["compile"] == "auto: whole decode step per bucket"
    # a machine whose compiles are cheap: a bucket compiles once its eager time passes that cost / SAVING
    decode_graphs._record_compile_s("cpu", g.record, 1e-4)
    got, e = generate(tiny_model_dir, "auto", compile="auto")
    g = e.runner.graphs
    assert got == ref and g.compile_after_s == pytest.approx(1e-4 / decode_graphs.SAVING)
    # rented first, then bought: per rows bucket (a pairs bucket of compiled rows runs their compiled code)
    assert g.compiled_rows == {B for B, _ in g.buckets} and all(
        g.eager_s[g.compile_key(B, 0)] >= g.compile_after_s for B in g.compiled_rows)
    assert g.num_steps > 0 and g.compile_s > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graphs_replay_the_same_tokens(tiny_model_dir):
    ref, _ = generate(tiny_model_dir, "off", device="cuda", attention_backend="torch")
    got, on = generate(tiny_model_dir, "on", device="cuda", attention_backend="torch")
    assert got == ref and on.runner.graphs.capture and "captured" in on.conditions()["cuda_graphs"]


def test_a_compile_that_fails_under_auto_falls_back_to_the_eager_step(tiny_model_dir, tmp_path, monkeypatch):
    """No C++ compiler, or an Inductor bug: `--compile auto` must not take a run down (the dynamic
    eager step serves every later step, and the conditions say why); `--compile on` raises."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # cold: the compiler must run
    torch._dynamo.reset()  # nor steps compiled by earlier tests in this process
    record_cheap_compiles(tiny_model_dir, dtype="float32", max_num_seqs=6)  # auto compiles at once
    ref, _ = generate(tiny_model_dir, "off", compile="off")
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # (Inductor's own patcher restores it)
        got, e = generate(tiny_model_dir, "auto", compile="auto")
        g = e.runner.graphs
        assert got == ref and "InvalidCxxCompiler" in g.failed and g.compile_s == 0
        assert e.conditions()["compile"].startswith("auto: whole decode step per bucket; failed (")
        with pytest.raises(Exception):
            generate(tiny_model_dir, "auto", compile="on")
    torch._dynamo.reset()


def test_run_json_records_the_seconds_compiled_during_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """Buckets compile on first use, after the attempt's conditions were first written: each shard's
    commit rewrites them, so run.json's compile_s counts every compile of the run."""
    import json

    from conftest import make_run

    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path))
    record_cheap_compiles(tiny_model_dir, max_num_seqs=4)  # auto compiles at once (the run's settings)
    doc = json.loads((make_run(tmp_path, tiny_model_dir, "compiled", max_num_seqs=4) / "run.json").read_text())
    engine = doc["conditions"]["engine"]
    assert engine["compile"] == "auto: whole decode step per bucket" and engine["compile_s"] > 0
    assert doc["attempts"][0]["conditions"]["engine"]["compile_s"] == engine["compile_s"]
