"""Batch invariance (EngineConfig.batch_invariant, on by default): a row's tokens do not depend on
max_num_seqs, the rows beside it, chunked prefill, prefix-cache hits or preemption. Checked on the real
model, greedy and seeded sampling side by side, in each weight format `--dtype auto` can choose on a
CPU (float32 on gemv, the model's GGUF blocks), and off where asked; the plan that decides it."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from batchgen.config import SamplingParams
from batchgen import kernels
from batchgen.model import bgemm, ggml, gemv
from batchgen.config import EngineConfig
from batchgen.engine.native import NativeEngine
from batchgen.engine.plan import INVARIANT_MATMULS, EnginePlan, PlanError
from conftest import TEST_DATA

GEMV = gemv.load()
needs_gemv = pytest.mark.needs(f"gemv kernel unavailable: {GEMV}" if isinstance(GEMV, str) else None,
                               "BATCHGEN_REQUIRE_KERNELS")
BGEMM = bgemm.load()
ISA = ggml.load()
needs_qgemv = pytest.mark.needs(f"qgemv kernel unavailable: {ISA}" if isinstance(ISA, str) else None,
                                "BATCHGEN_REQUIRE_KERNELS")

MAX_TOKENS = 12


def prompts() -> list[str]:
    """Ten real prompts; four share a long first part, so prefix-cache hits happen (and which row pays
    for the prefix depends on the batch)."""
    rows = pq.read_table(TEST_DATA / "alpaca_seed_prompts.parquet").column("prompt").to_pylist()
    shared = "You are a careful assistant. Answer in one short paragraph, plainly. " * 3
    return rows[:6] + [shared + q for q in rows[6:10]]


def sampling(i: int) -> SamplingParams:  # even rows greedy, odd rows sampled with their own seed
    if i % 2 == 0:
        return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=7 + i, ignore_eos=True)


# the batches a row can land in: alone; 7 at a time with prompts cut into 24-token chunks and n-gram
# drafts verified in one pass; all at once in a pool too small for all of them (preemption)
SHAPES = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=7, chunked prefill, speculation": dict(max_num_seqs=7, max_num_batched_tokens=24,
                                                         speculative_ngram=3),
    "max_num_seqs=64, preempted": dict(max_num_seqs=64, kv_cache_tokens=320, block_size=16),
}


def engine_tokens(model_dir, texts: list[str], **config) -> tuple[dict, dict]:
    """(request id -> output token ids, the engine's conditions with the run's preemptions and cache hits)."""
    e = NativeEngine(model_dir, EngineConfig(**config))
    for i, p in enumerate(texts):
        e.add(str(i), e.tokenizer.encode(p), sampling(i))
    out, preempted, cached, drafts = {}, 0, 0, 0
    while e.has_unfinished():
        step = e.step()
        drafts += step.num_draft_tokens
        for f in step.finished:
            out[f.request_id] = f.output_token_ids
            preempted += f.num_preemptions
            cached += f.num_cached_tokens
    return out, {**e.conditions(), "preemptions": preempted, "cached_tokens": cached, "drafts": drafts}


def run_shapes(model_dir, speculation: bool = True, **config) -> tuple[dict[str, dict], dict[str, dict]]:
    outs, conds = {}, {}
    for name, shape in SHAPES.items():
        if not speculation:
            shape = {k: v for k, v in shape.items() if k != "speculative_ngram"}
        outs[name], conds[name] = engine_tokens(model_dir, prompts(), **{**shape, **config})
    assert conds["max_num_seqs=64, preempted"]["preemptions"] > 0  # the shapes do what they say
    assert (conds["max_num_seqs=7, chunked prefill, speculation"]["drafts"] > 0) == speculation
    assert any(c["cached_tokens"] for c in conds.values())
    return outs, conds


def assert_invariant(outs: dict[str, dict]) -> None:
    first, *rest = outs.values()
    assert len(first) == len(prompts()) and all(len(t) == MAX_TOKENS for t in first.values())
    for name, out in outs.items():
        differ = sorted(rid for rid in first if out[rid] != first[rid])
        assert not differ, f"{name}: rows {differ} differ from {next(iter(outs))}"


@needs_gemv
def test_float32_rows_do_not_depend_on_the_batch(real_model_dir):
    outs, conds = run_shapes(real_model_dir, dtype="float32")
    assert_invariant(outs)
    for c in conds.values():
        assert c["plan"]["batch_invariant"] and c["plan"]["matmul"] == "gemv" and "gemv" in c["weight_layout"], c


@needs_qgemv
def test_gguf_blocks_rows_do_not_depend_on_the_batch(real_model_dir):
    outs, conds = run_shapes(real_model_dir, quantization="gguf")
    assert_invariant(outs)
    assert all(c["plan"]["batch_invariant"] and c["plan"]["matmul"] == "qgemv" for c in conds.values())
    assert all(c["batch_invariant"].startswith("on: GGUF blocks") for c in conds.values())  # the prose says so


@pytest.mark.needs(f"bgemm kernel unavailable: {BGEMM}" if BGEMM and "avx512_bf16" not in kernels._cpu_flags()
                   else None, "BATCHGEN_REQUIRE_BGEMM")
def test_bfloat16_rows_do_not_depend_on_the_batch_compiled_or_not(real_model_dir):
    """bf16 on batchgen's bgemm, n-gram drafts verified in one pass, with the decode step compiled too:
    a decode row runs compiled in a decode-only step and eager beside a prompt chunk or a draft, so the
    compiled step must round where eager does (emulate_precision_casts) and sum each row's RMSNorm in the
    eager order (batchgen's rmsnorm kernel in both: Inductor's own fused norm adds in another order, and
    a greedy row's tokens changed with it). The reference is every row alone, never compiled."""
    # one KV pool for every shape: a compiled bucket's graph holds the pool's size, so the shapes share
    # their compiles (and this pool is what exposed the norm's order: its shapes hit a compiled bucket
    # where the eager reference ran eager)
    outs, conds = {}, {}
    outs["alone, eager"], conds["alone, eager"] = engine_tokens(real_model_dir, prompts(), max_num_seqs=1,
                                                                dtype="bfloat16", compile="off")
    shaped, shaped_conds = run_shapes(real_model_dir, dtype="bfloat16", compile="on", kv_cache_tokens=320,
                                      block_size=16)
    outs.update(shaped)
    conds.update(shaped_conds)
    assert_invariant(outs)
    assert all(c["batch_invariant"].startswith("on: bfloat16 on bgemm") for c in conds.values()), conds
    assert all("fixed-order RMSNorm and RoPE" in c["batch_invariant"] for c in conds.values())
    # attention's bf16 instructions are named: AMX and VDPBF16PS round apart
    isa = torch.ops.batchgen_attention.bf16_isa()
    assert all(f"C++ paged attention ({isa})" in c["batch_invariant"] for c in conds.values()), conds
    assert all(c["weight_layout"].startswith("bgemm-tiled") for c in conds.values())
    assert all("per bucket" in c["compile"] for n, c in conds.items() if n != "alone, eager")
    # `--dtype auto` with speculation keeps bf16 where it is the machine's invariant choice
    _, c = engine_tokens(real_model_dir, prompts()[:1], speculative_ngram=3)
    _, plain = engine_tokens(real_model_dir, prompts()[:1])
    assert c["plan"]["batch_invariant"] and c["dtype"] == plain["dtype"], (c["batch_invariant"], plain["dtype"])


@needs_gemv
def test_default_flags_give_the_same_rows_at_every_max_num_seqs(real_model_dir):
    """The plan (`--dtype auto`, the kernels, invariance) depends on the settings and the machine,
    never on the run's own max_num_seqs: with default flags, batches of 1, 7 and 32 take one plan and
    give the same rows the same tokens, greedy and sampled. The plan's `why` is prose for people."""
    outs, plans = {}, []
    for mns in (1, 7, 32):
        outs[f"max_num_seqs={mns}"], c = engine_tokens(real_model_dir, prompts(), max_num_seqs=mns)
        plans.append(EnginePlan.from_fields(c["plan"]))
    assert plans[0].batch_invariant and plans[0].matmul in INVARIANT_MATMULS, plans[0]
    assert plans.count(plans[0]) == 3, plans  # the same dtype, weights, kernels (their `why` aside)
    assert_invariant(outs)


def test_a_kernel_that_sums_by_the_batch_is_said_under_auto_and_refused_under_on(real_model_dir):
    _, c = engine_tokens(real_model_dir, prompts()[:1], dtype="float32", fp32_kernel="onednn")
    assert not c["plan"]["batch_invariant"] and c["plan"]["matmul"] == "onednn", c["plan"]
    assert c["batch_invariant"].startswith("off: float32 weights on onednn, whose row sums depend on the batch")
    _, c = engine_tokens(real_model_dir, prompts()[:1], dtype="float32", batch_invariant="off")
    assert c["batch_invariant"] == "off: as asked (the fastest kernels for max_num_seqs' batch band)"
    with pytest.raises(PlanError, match="--batch-invariant on: this run cannot be batch-invariant here "
                                        r"\(float32 weights on onednn"):
        engine_tokens(real_model_dir, prompts()[:1], dtype="float32", fp32_kernel="onednn", batch_invariant="on")


def cli(inp, out, model, run_id, max_num_seqs, *extra) -> list[str]:
    return ["generate", "--input", str(inp), "--output", str(out), "--run-id", run_id, "--model", str(model),
            "--max-tokens", "8", "--max-model-len", "256", "--shard-size", "4", "--max-num-seqs", str(max_num_seqs),
            "--temperature", "0.8", "--top-p", "0.95", "--seed", "7", "--ignore-eos", "--no-progress", *extra]


@needs_gemv
def test_kill_and_resume_with_wider_batches_gives_the_same_rows(tmp_path, real_model_dir):
    """SIGKILL in the middle of shard 1, resume with max_num_seqs 5 instead of 2 (the batch-shaping
    settings may change on resume when the run is batch-invariant): every row equals a clean run's at
    max_num_seqs 1, sampled rows included."""
    from conftest import read_run_table, run_cli_subprocess, write_prompts

    inp = write_prompts(tmp_path / "in.parquet", prompts(), ids=[f"r{i}" for i in range(len(prompts()))])
    out = tmp_path / "runs"
    killed = run_cli_subprocess(cli(inp, out, real_model_dir, "crash", 2), kill_at="step:24")
    assert killed.returncode == -9, killed.stderr
    assert len(list((out / "crash" / "_manifests").glob("*.json"))) == 1  # shard 0 committed, shard 1 was running
    resumed = run_cli_subprocess(cli(inp, out, real_model_dir, "crash", 5))
    assert resumed.returncode == 0 and "(resumed)" in resumed.stdout, resumed.stderr
    clean = run_cli_subprocess(cli(inp, out, real_model_dir, "clean", 1))
    assert clean.returncode == 0, clean.stderr

    def rows(run):
        return {r["id"]: r["output_token_ids"] for r in read_run_table(out / run, "requests").to_pylist()}

    assert rows("crash") == rows("clean") and len(rows("clean")) == len(prompts())
    # without invariance the batch shape is part of the run's identity: a resume that changes it is refused
    off = cli(inp, out, real_model_dir, "off", 2, "--batch-invariant", "off", "--max-tokens", "1")
    assert run_cli_subprocess(off).returncode == 0
    refused = run_cli_subprocess(off[:-2] + ["--max-num-seqs", "5", "--max-tokens", "1"])
    assert refused.returncode == 2 and "engine settings" in refused.stderr, refused.stderr


@needs_gemv
@needs_qgemv
def test_a_resume_keeps_the_plan_the_run_started_with(tmp_path, real_model_dir):
    """A resume reads the first attempt's plan back from run.json as an EnginePlan (never from its
    prose) and keeps its weights under `--dtype auto`, so a machine whose measurements moved between
    attempts changes no token; weights asked for, and a run that was not batch-invariant, are not pinned."""
    from dataclasses import replace

    from batchgen.data.run_dir import RunDir
    from batchgen.engine.resolve import plan_engine
    from batchgen.worker import plan_as_started

    fresh = plan_engine("native", real_model_dir, EngineConfig())
    # the run started with the other weights than this machine takes today
    other = (EnginePlan("native", "cpu", "float32", "gguf", "qgemv", "cpu", True, {"dtype": "a measurement"})
             if fresh.weights == "dense" else
             EnginePlan("native", "cpu", "float32", "dense", "gemv", "cpu", True, {"dtype": "a measurement"}))

    def started(plan: EnginePlan, at: str) -> EnginePlan | None:
        run = RunDir(tmp_path / at)
        run.record_attempt({"engine": {"plan": plan.fields(), "dtype": plan.dtype}})
        return plan_as_started(run)

    assert started(other, "other") == other and started(other, "again").why == other.why
    assert plan_as_started(RunDir(tmp_path / "fresh")) is None
    pinned = plan_engine("native", real_model_dir, EngineConfig(max_num_seqs=64), started=other)
    assert (pinned.weights, pinned.matmul, pinned.batch_invariant) == (other.weights, other.matmul, True)
    assert pinned.why["dtype"].startswith("as the run's first attempt took")
    ask, want = (({"dtype": "float32"}, "dense") if other.weights == "gguf" else ({"quantization": "gguf"}, "gguf"))
    assert plan_engine("native", real_model_dir, EngineConfig(**ask), started=other).weights == want  # asked: not pinned
    loose = replace(other, batch_invariant=False)
    assert plan_engine("native", real_model_dir, EngineConfig(), started=loose) == fresh


def test_batch_invariant_on_where_it_cannot_hold_is_refused_before_the_run(tmp_path, real_model_dir):
    """`--batch-invariant on` refuses a plan that cannot be invariant (exit 2, no run directory);
    `auto`, the default, runs it and says so on stderr before the run starts."""
    from conftest import run_cli_subprocess, write_prompts

    inp = write_prompts(tmp_path / "in.parquet", prompts()[:2])
    out = tmp_path / "runs"
    args = cli(inp, out, real_model_dir, "onednn", 2, "--dtype", "float32", "--fp32-kernel", "onednn",
               "--max-tokens", "2")
    refused = run_cli_subprocess(args + ["--batch-invariant", "on"])
    assert refused.returncode == 2, refused.stderr
    assert "--batch-invariant on: this run cannot be batch-invariant here" in refused.stderr
    assert not (out / "onednn").exists()
    ran = run_cli_subprocess(args)
    assert ran.returncode == 0, ran.stderr
    assert "batchgen: not batch-invariant: float32 weights on onednn" in ran.stderr, ran.stderr
