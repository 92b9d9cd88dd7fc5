"""The decode step in static buckets (what CUDA graphs replay on GPU): padding rows and pairs must
never change a token. On CPU the same padded, static-buffer step runs eagerly (there are no CUDA
graphs to capture here); the capture itself runs only on CUDA."""

import pytest
import torch

from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine.decode_graphs import bucket
from batchgen.engine.native import NativeEngine

from test_engine import run_all


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]


def generate(model_dir, cuda_graphs, dtype="float32", **cfg):
    e = NativeEngine(model_dir, EngineConfig(max_num_seqs=6, max_model_len=160, dtype=dtype,
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graphs_replay_the_same_tokens(tiny_model_dir):
    ref, _ = generate(tiny_model_dir, "off", device="cuda", attention_backend="torch")
    got, on = generate(tiny_model_dir, "on", device="cuda", attention_backend="torch")
    assert got == ref and on.runner.graphs.capture and "captured" in on.conditions()["cuda_graphs"]
