"""The speed targets' judge: verdicts read back from bench runs' Parquet files, the Markdown table made
from them, the series of runs that measures them, and one real step of it on the tiny model. (The
figures in the table tests are made up for the purpose; speeds are never asserted.)"""

import sys

import pytest

from batchgen.benchmarks import judge
from batchgen.benchmarks.bench_results import Measurement, read_results, verdicts, write_parquet

XEON = {"date": "2026-12-06 20:04:09", "cpu": "Intel(R) Xeon(R) Processor", "repeats": 3, "cores": 2,
        "torch_threads": 2, "cpu_features": "Intel family 6 model 167: avx2 fma f16c avx512f amx_bf16",
        "peak_flops": {"float32": 2.8e11, "bfloat16": 1.474e12}, "prompts": "chat prompts of 300 tokens",
        "prompt_length": 300}
ZEN3 = {**XEON, "date": "2026-12-06 02:53:00", "cpu": "AMD EPYC 7B13 64-Core Processor", "repeats": 5,
        "cpu_features": "AMD family 25 model 1: avx2 fma f16c", "peak_read_beside_repeats": [38.8e9]}


def cell(engine, dtype, batch, tok_s, **extra):
    return Measurement(section="grid", engine=engine, dtype=dtype, batch=batch, mode="greedy", workload="held",
                       speculative_k=0, prompts=batch, tokens=int(tok_s * 10), seconds=10.0, **extra)


def test_a_runs_verdicts_come_back_from_its_parquet(tmp_path):
    results = [cell("native:compiled", "float32", 64, 135.3, itl_p50_s=0.05),
               cell("vllm-generate:fp32", "float32", 64, 71.1),
               cell("native:auto", "bfloat16", 64, 429.2, prefill_tok_per_s=4429.0, prefill_mfu=0.64)]
    path = write_parquet(results, XEON, tmp_path / "run.parquet")
    back, conditions = read_results(path)
    assert conditions == XEON and [(m.engine, m.tokens, m.seconds, m.itl_p50_s) for m in back] == [
        (m.engine, m.tokens, m.seconds, m.itl_p50_s) for m in results]
    assert [v.line for v in verdicts(back, conditions)] == [v.line for v in verdicts(results, XEON)]
    with pytest.raises(ValueError, match="no measurements"):
        read_results(write_parquet([], {}, tmp_path / "empty.parquet"))


def test_the_table_has_a_row_a_target_and_run_cpu_by_cpu(tmp_path):
    """Each row counts the repeats its own cells had (a peer that died has fewer), gives the ratio's range
    over the repeats (each repeat of native against the same repeat of its peer), and says where each
    engine computed; prefill MFU is judged only against the peak measured beside its repeats."""
    on = dict(cores="0-1", threads=2)
    xeon = write_parquet([cell("native:default", "float32", 64, 135.3, repeats=3, **on,
                               repeat_tok_per_s=[140.0, 135.3, 130.0]),
                          cell("vllm-generate:fp32", "float32", 64, 71.1, repeats=3, **on,
                               repeat_tok_per_s=[72.0, 71.1, 70.0]),
                          cell("native:auto", "bfloat16", 64, 429.2, repeats=2, prefill_tok_per_s=4429.0,
                               prefill_mfu=0.64, peak_flops=1.474e12)],
                         XEON, tmp_path / "xeon.parquet")
    zen3 = write_parquet([cell("llama.cpp", "Q4_1", 1, 80.0, decode_tok_per_s=92.7, repeats=5),
                          cell("native:auto", "float32", 1, 100.0, decode_tok_per_s=111.0, decode_mbu_p50=0.43,
                               peak_read_bytes_per_s=38.8e9, repeats=5)], ZEN3, tmp_path / "zen3.parquet")
    text = judge.table([xeon, zen3])
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == [
        "| AMD EPYC, Zen 3 (family 25 model 1) | batch 1, decode steps, native:auto (float32) | 2026-12-06 02:53, "
        "median of 5 | 111.0 tok/s (native:auto) | llama.cpp Q4_1 92.7 | **1.20x** (1.0x: met) |  |",
        "| AMD EPYC, Zen 3 (family 25 model 1) | batch 1, decode MBU at the median step, default | 2026-12-06 02:53, "
        "median of 5 | 111.0 tok/s (native:auto) | the read peak beside its repeats, 38.8 GB/s | **MBU 0.43** "
        "(0.6: MISSED) |  |",
        "| Intel Xeon (family 6 model 167) | batch 64, float32 | 2026-12-06 20:04, median of 3 | 135.3 tok/s "
        "(native:default, cores 0-1, 2 threads) | vLLM `generate` 71.1, cores 0-1, 2 threads | **1.90x** (1.2x: met) "
        "| 1.86-1.94x |",
        "| Intel Xeon (family 6 model 167) | batch 64 prefill, bfloat16, chat prompts of 300 tokens | "
        "2026-12-06 20:04, median of 2 | 4,429 prompt tok/s (native:auto) | the bfloat16 matmul peak beside its "
        "repeats, 1,474 GFLOP/s | **MFU 0.64** (0.6: met) |  |"]
    assert "- AMD EPYC, Zen 3 (family 25 model 1): AMD family 25 model 1: avx2 fma f16c; 2 cores" in text
    assert f"from {xeon}, {zen3}" in text


def test_the_table_shows_vllm_on_its_own_binding_and_native_scaling_from_one_core(tmp_path):
    """vLLM on its default binding (a core reserved for its scheduler) is shown beside native, never
    judged; a run on one core (taskset) beside one on both gives native's scaling (target 1.8x) with
    vLLM's own beside it."""
    both = {**ZEN3, "cores_used": "0-1", "date": "2026-12-07 17:00:00"}
    one = {**ZEN3, "cores_used": "0", "date": "2026-12-07 17:30:00"}
    files = [write_parquet([cell("native:default", "float32", 64, 120.0, cores="0-1", threads=2),
                            cell("vllm-generate:fp32", "float32", 64, 100.0, cores="0-1", threads=2),
                            cell("vllm-generate:fp32:default", "float32", 64, 70.0,
                                 cores="vLLM's default (one core reserved for its scheduler)")],
                           both, tmp_path / "both.parquet"),
             write_parquet([cell("native:default", "float32", 64, 70.0, cores="0", threads=1),
                            cell("vllm-generate:fp32", "float32", 64, 60.0, cores="0", threads=1)],
                           one, tmp_path / "one.parquet")]
    text = judge.table(files)
    shown = next(line for line in text.splitlines() if "vLLM on its default cores" in line)
    assert "**" not in shown and "1.71x (not judged)" in shown and "one core reserved" in shown
    scaling = next(line for line in text.splitlines() if "native on 2 cores / on 1" in line)
    assert "120.0 tok/s / 70.0" in scaling and "**1.71x** (1.8x: MISSED)" in scaling
    assert "vLLM `generate` 100.0 on 2 cores / 60.0 on 1: 1.67x" in scaling


@pytest.mark.parametrize("cpu, features, label", [
    ("AMD EPYC 9B14 96-Core Processor", "AMD family 25 model 17: avx2 avx512f", "AMD EPYC, Zen 4 (family 25 model 17)"),
    ("AMD EPYC 7B13 64-Core Processor", "AMD family 25 model 1: avx2; capped to avx2 (ATEN_CPU_CAPABILITY)",
     "AMD EPYC, Zen 3 (family 25 model 1), capped to avx2"),
    ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "Intel family 6 model 143: avx2",
     "Intel Xeon (family 6 model 143)"),
    ("Neoverse-V2", "aarch64", "Neoverse-V2"),
])
def test_the_cpu_is_named_by_its_model_core_family_and_cap(cpu, features, label):
    assert judge.cpu_label({"cpu": cpu, "cpu_features": features}) == label


def test_the_series_measures_each_target_once_and_leaves_bf16_out_without_bf16_math(tmp_path):
    steps, skipped = judge.series(tmp_path, bf16_math=True)
    assert [s.name for s in steps] == list(judge.STEPS) and not skipped
    assert all(sys.executable in s.argv[:4] and s.argv[-2:] == ["--out", str(s.out)] and s.out.parent == tmp_path
               for s in steps)
    by = {s.name: " ".join(s.argv) for s in steps}
    # generate's default flags judged; with bf16 math they take bf16, so fp32 needs its float32 row too
    assert "--engines native,vllm-generate:fp32 --native-variants default,compiled --batches 64,256" in by["fp32"]
    assert "--prompt-tokens 300" in by["prefill"] and "--repeats 5" in by["batch1"]  # batch 1: at least 5 runs
    assert "vllm-generate:fp32:default --native-variants default --batches 64" in by["vllm-default"]
    assert by["one-core"].startswith("taskset -c ") and "--engines native,vllm-generate:fp32" in by["one-core"]
    assert "vllm_wrapper --model smollm2-135m --dtype bfloat16" in by["wrapper"]
    steps, skipped = judge.series(tmp_path, bf16_math=False, batches="64")
    assert "bf16" not in [s.name for s in steps] and "no bf16 math" in skipped[0]
    assert "--native-variants default --batches 64 " in " ".join(steps[0].argv)
    assert "--dtype float32" in " ".join(next(s for s in steps if s.name == "wrapper").argv)
    assert judge.has_bf16_math({"peak_flops_fp32": 2.8e11, "peak_flops_bfloat16": 1.5e12})
    assert not judge.has_bf16_math({"peak_flops_fp32": 1.67e11, "peak_flops_bfloat16": 2.8e8})
    with pytest.raises(ValueError, match="unknown step 'fp16'"):
        judge.series(tmp_path, True, only=("fp16",))


@pytest.mark.slow
def test_a_real_step_of_the_series_writes_its_run_and_the_table(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "targets"
    rc = judge.main(["run", "--only", "prefill", "--repeats", "1", "--model", str(tiny_model_dir), "--out", str(out)])
    assert rc == 0 and (out / "prefill.parquet").is_file() and (out / "prefill.log").is_file()
    text = (out / "targets.md").read_text()
    assert "| batch 64 prefill, " in text and "chat prompts of 300 tokens" in text and "one run" in text
    assert text.strip() in capsys.readouterr().out
    # a step that fails is named, with its log, and the run exits 1; an earlier run's file is not tabled
    assert judge.main(["run", "--only", "prefill", "--model", str(tmp_path / "missing"), "--out", str(out)]) == 1
    assert "failed: prefill (exit" in capsys.readouterr().out and not (out / "prefill.parquet").exists()
