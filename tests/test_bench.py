"""`batchgen bench` end to end on the tiny model: every engine measured in one run, ratios and the
Parquet of results. (Speeds are printed, never asserted.)"""

import pyarrow.parquet as pq
import pytest

from batchgen.benchmarks.bench import run_bench
from batchgen.benchmarks.bench_results import format_bench, write_parquet
from batchgen.model.linear import fp32_kernel

pytestmark = pytest.mark.slow


def test_bench_measures_each_engine_batch_and_mode_and_writes_parquet(tmp_path, tiny_model_dir):
    results, conditions = run_bench(tiny_model_dir, ["native", "hf"], [1, 2], ["greedy", "sampled"], new_tokens=4,
                                    speculative_k=2, spec_batch=2, log=lambda *_: None)
    grid = [m for m in results if m.section == "grid"]
    # where fp32 runs batchgen's gemv kernel, oneDNN's is measured beside it (compiled)
    gemv_on = fp32_kernel("auto", "cpu")[0] is not None
    # native:default is generate's default flags (its step compiles once eager steps cost what a compile does)
    compiled = ("native:default", "native:compiled",) + ("native:onednn",) * gemv_on + (
        "native:auto", "native:loose", "native:int4")
    assert {(m.engine, m.batch, m.mode) for m in grid} == {
        (e, b, mode) for e in ("native", *compiled, "hf") for b in (1, 2) for mode in ("greedy", "sampled")}
    for m in grid:
        assert m.tokens == m.prompts * 4 and m.seconds > 0  # ignore_eos: every prompt its 4 tokens
        assert m.itl_p50_s <= m.itl_p99_s and m.mbu > 0 and m.vs_best_peer > 0
        # compiled variants compile in an untimed warm-up per batch; the eager ones have none
        assert (m.compile_s is not None) == (m.engine in compiled)
        # the native engine's time choosing tokens, a share of its decode steps; the peer reports none
        native = m.engine.startswith("native")
        assert (0 < m.sample_share < 1 and m.decode_mbu_p50 > 0) if native else m.sample_share is None
        # prefill's matmul FLOPs over the run's own peak in the dtype (float32 and bfloat16 are measured; a
        # loose auto may take float16, e.g. on a Zen 4): the native engine's rows only
        measured = native and m.dtype in conditions["peak_flops"]
        assert (m.prefill_mfu > 0) if measured else m.prefill_mfu is None
        assert m.step_itl_p50_s > 0
        # where and at what cost each engine computed: this process's cores, torch's threads, CPU seconds
        assert m.cores == conditions["cores_used"] and m.threads >= 1 and m.cpu_s > 0
        assert m.preemptions == 0 and len(m.repeat_tok_per_s) == m.repeats == 1  # KV for every row: none preempted
        # every call computes its prompts: the prefix cache is emptied before it (warm-up and repeats send the
        # same prompts), so at most the template's head, shared by the call's own rows, comes from it
        assert (m.cached_prompt_tokens or 0) <= 32 * m.prompts, (m.engine, m.cached_prompt_tokens)
    assert any(m.compile_s > 0 for m in grid if m.engine == "native:compiled")
    auto = [m for m in grid if m.engine in compiled and m.mode == "greedy"]
    assert len(auto) == 2 * len(compiled) and all(0 <= m.agreement_fp32 <= 1 for m in auto)
    # compiled fp32 computes what eager fp32 does: the same greedy tokens
    assert all(m.agreement_fp32 == 1.0 for m in auto if m.engine == "native:compiled")
    spec = [m for m in results if m.section == "speculative"]
    assert {(m.workload, m.speculative_k) for m in spec} == {("copy", 0), ("copy", 2), ("open", 0), ("open", 2)}
    assert all(m.identical_to_off for m in spec if m.speculative_k)  # speculation never changes the output
    text = format_bench(results, conditions)
    assert "targets (this run):" in text and "vs best peer" in text and conditions["cores"] >= 1
    assert "measured at the start of this run" in text and conditions["peak_read_bytes_per_s"] > 0
    # the read peak is measured again beside each repeat (per batch and engine group), and each cell
    # records the one its MBU is against
    beside = conditions["peak_read_beside_repeats"]
    assert len(beside) >= 4 and all(b > 0 for b in beside) and "read peak beside each repeat" in text
    assert all(m.peak_read_bytes_per_s in beside for m in grid)
    assert all(conditions["peak_flops"][d] > 0 for d in ("float32", "bfloat16")) and "GFLOP/s in bfloat16" in text
    # and the matmul peak in each native cell's dtype: a cell's prefill MFU is against those beside its repeats
    flops = conditions["peak_flops_beside_repeats"]
    assert {m.dtype for m in grid if m.prefill_mfu} <= set(flops) and "matmul peak beside each repeat" in text
    assert all(m.peak_flops in flops[m.dtype] for m in grid if m.prefill_mfu)
    assert all(m.peak_flops is None for m in grid if not m.engine.startswith("native"))
    assert "pre MFU" in text and conditions["prompt_token_flops"] > 0
    assert "batch 1 decode MBU at the median step, default (native:default" in text and "protocol: " in text
    assert "batch 1 decode MBU at the median step, fp32 (" in text and "sampled / greedy (native fp32), median " \
        "decode step" in text and "of the decode steps sampled" in text
    assert ("gemv kernel / oneDNN's (compiled), median decode step" in text) == gemv_on
    # what batch invariance costs, at each batch: the default auto against auto with it off
    assert all(f"batch {b} greedy, batch-invariant auto" in text for b in (1, 2))
    if gemv_on:  # and what `--fp32-kernel auto` takes at each batch, from this machine's crossover
        assert set(conditions["fp32_kernel_auto"]) == {"1", "2"}
        assert all(f"--fp32-kernel auto takes {k} at this batch" in text for k in conditions["fp32_kernel_auto"].values())
    table = pq.read_table(write_parquet(results, conditions, tmp_path / "bench.parquet"))
    assert table.num_rows == len(results) and {"tok_per_s", "itl_p99_s", "decode_mbu", "conditions"} <= set(
        table.column_names)


def test_repeats_alternate_the_modes_and_keep_the_median(tiny_model_dir):
    # two of the native variants, one eager and one compiled (the test above runs every one once)
    results, conditions = run_bench(tiny_model_dir, ["native"], [2], ["greedy", "sampled"], new_tokens=3,
                                    speculative_k=0, log=lambda *_: None, repeats=3, native_variants=("eager", "auto"))
    grid = [m for m in results if m.section == "grid"]
    assert {m.engine for m in grid} == {"native", "native:auto"}
    assert len(grid) == 4 and conditions["repeats"] == 3  # two variants x two modes
    assert all(m.repeats == 3 and m.spread is not None and m.spread >= 0 for m in grid)
    assert all(m.tokens == m.prompts * 3 for m in grid)
    assert "the median shown" in format_bench(results, conditions) and "spread" in format_bench(results, conditions)


def test_prompts_of_a_set_length_for_the_prefill_target(tiny_model_dir):
    """`--prompt-tokens N`: N-token chat prompts of real text (held instructions joined and cut), no two
    with a shared prefix, each ending in the template's turn for the assistant; the run says so."""
    from batchgen.benchmarks.bench import sized_prompt_ids
    from batchgen.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    ids = sized_prompt_ids(tok, 12, 120)
    assert len(ids) == 12 and all(119 <= len(p) <= 120 for p in ids), [len(p) for p in ids]  # a cut may merge a token
    x = tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}]))
    head = x[:x.index(tok.encode("x")[0])]  # the template up to the message (a system prompt, the turn's start)
    assert all(p[:len(head)] == head and p[-3:] == x[-3:] for p in ids)  # ... and the assistant's turn last
    assert len({tuple(p[len(head):len(head) + 16]) for p in ids}) == 12  # messages that do not share a start
    with pytest.raises(ValueError, match="the chat template alone takes"):
        sized_prompt_ids(tok, 2, 3)
    results, conditions = run_bench(tiny_model_dir, ["native"], [2], ["greedy"], new_tokens=2, speculative_k=0,
                                    log=lambda *_: None, native_variants=("eager",), prompt_tokens=120)
    assert conditions["prompts"].startswith("chat prompts of 120 tokens") and "120 tokens" in format_bench(
        results, conditions)
    assert all(m.tokens == m.prompts * 2 for m in results if m.section == "grid")


def test_the_grid_prompts_are_few_shot_chat_prompts_of_100_to_500_tokens(tiny_model_dir):
    """The bench's default prompts are of real length, as a dataset-generation job writes them: held
    tasks with their answers as examples, then a task to answer; 100 to 500 tokens, lengths spread over
    the range, and no two starting with the same example (no prefix cache serves one from another)."""
    from batchgen.benchmarks.bench import PROMPT_TOKENS, held_prompt_ids, held_tasks
    from batchgen.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    ids = held_prompt_ids(tok, 256)  # past the 175 tasks as well
    lengths = [len(p) for p in ids]
    assert all(PROMPT_TOKENS[0] <= n <= PROMPT_TOKENS[1] for n in lengths), (min(lengths), max(lengths))
    assert sum(n < 200 for n in lengths) >= 20 and sum(n > 400 for n in lengths) >= 20  # spread, not bunched
    x = tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}]))
    head = x[:x.index(tok.encode("x")[0])]
    firsts = {tok.decode(p[len(head):]).split("\nAnswer: ")[0] for p in ids}  # (a variant number and) the first example
    assert len(firsts) == 256  # every message starts its own way
    tasks = held_tasks()
    assert len(tasks) == 175 and all(t and a for t, a in tasks)
    text = tok.decode(ids[7])
    assert text.count("Answer:") >= 2 and text.rstrip().endswith(tok.decode(x[-3:]).rstrip())  # examples, then the turn
    assert any(a in text for _, a in tasks)  # an example's real answer is shown


def test_a_peer_that_is_not_installed_is_left_out_with_a_line(tiny_model_dir, monkeypatch):
    """llama.cpp and vLLM's own generate are optional peers: a run without them says so and goes on."""
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "vllm", None)
    lines = []
    results, _ = run_bench(tiny_model_dir, ["native", "llama.cpp", "vllm-generate"], [1], ["greedy"], new_tokens=2,
                           speculative_k=0, log=lines.append, native_variants=("eager",))
    assert [m.engine for m in results] == ["native"]
    assert any(line.startswith("llama.cpp left out: llama-cpp-python is not installed") for line in lines)
    assert any(line.startswith("vllm-generate left out: vLLM is not installed") for line in lines)


class PrefixCachingLLMDouble:
    """A test double for vllm.LLM, with its prefix cache: a prompt it has seen since the last
    reset_prefix_cache comes back with its whole 16-token blocks counted as cached, as vLLM reports."""

    def __init__(self, **kwargs):
        self.seen: set[tuple[int, ...]] = set()
        self.calls: list[str] = []

    def reset_prefix_cache(self):
        self.seen.clear()
        self.calls.append("reset")
        return True

    def generate(self, prompts, params, use_tqdm=False):
        import types

        self.calls.append("generate")
        outs = []
        for p in prompts:
            ids = tuple(p["prompt_token_ids"])
            cached = (len(ids) - 1) // 16 * 16 if ids in self.seen else 0
            self.seen.add(ids)
            outs.append(types.SimpleNamespace(num_cached_tokens=cached,
                                              outputs=[types.SimpleNamespace(token_ids=[1] * params.max_tokens)]))
        return outs


def test_vllm_generate_computes_every_repeats_prompts(monkeypatch):
    """The bench sends vLLM the same prompts in its warm-up and every repeat; each call is made on an
    emptied prefix cache (vLLM's default stays on), so no repeat is served from the one before."""
    import vllm

    from batchgen.benchmarks import peers

    monkeypatch.setattr(vllm, "LLM", PrefixCachingLLMDouble)
    runner = peers.VllmOwnRunner("model", "float32", 2, 64, 1 << 20)
    prompts = [list(range(5, 45)), list(range(50, 90)), list(range(100, 140))]
    got = [runner.run(prompts, 2, 3) for _ in range(3)]
    assert [g["cached_prompt_tokens"] for g in got] == [0, 0, 0]
    assert [g["tokens"] for g in got] == [9, 9, 9]
    calls = runner.llm.calls
    assert calls == ["reset", "generate"] * (1 + 2 * 3)  # the warm-up, then two calls (of 2 and 1 prompts) a run
    again = runner.llm.generate([{"prompt_token_ids": prompts[2]}], vllm.SamplingParams(max_tokens=1))
    assert again[0].num_cached_tokens == 32  # without the reset the double serves a repeat, as vLLM does


def test_vllm_computes_on_the_cores_it_races_on_unless_told_to_keep_its_own_binding(tiny_model_dir, monkeypatch):
    """Equal compute: vLLM's model threads are bound to this process's cores (VLLM_CPU_OMP_THREADS_BIND,
    read by its engine core as it starts), so it does not reserve one for its scheduler; `:default`
    keeps vLLM's own binding, and its row is shown, never judged. vLLM's KV is sized in its own
    128-position blocks, room for every row in flight."""
    import os
    import sys
    import types

    import vllm

    from batchgen.benchmarks import peers
    from batchgen.benchmarks.bench import is_peer

    seen = []

    class BindingLLMDouble(PrefixCachingLLMDouble):  # a test double for vllm.LLM: records what it started with
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seen.append((os.environ.get(peers.VLLM_BIND), kwargs["kv_cache_memory_bytes"]))

    monkeypatch.setattr(vllm, "LLM", BindingLLMDouble)
    monkeypatch.setenv(peers.VLLM_BIND, "7")  # the user's own setting stays theirs outside the start
    peers.VllmOwnRunner("m", "float32", 2, 64, 1 << 20, cores="0-1")
    peers.VllmOwnRunner("m", "float32", 2, 64, 1 << 20)
    assert [b for b, _ in seen] == ["0-1", None] and os.environ[peers.VLLM_BIND] == "7"
    assert peers.cpu_list([3, 0, 1, 2, 6]) == "0-3,6" and peers.cpu_ids("0-3,6") == [0, 1, 2, 3, 6]
    # two rows of 100 and 130 prompt tokens, 64 new: 2 + 2 blocks of 128, one more each
    assert peers.vllm_kv_bytes([100, 130], 64, 10) == (3 + 3) * 128 * 10
    assert is_peer("vllm-generate:fp32:default") and not is_peer("vllm-generate:default")
    assert not is_peer("llama.cpp:fp32")

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # "installed"; a double stands in for it
    monkeypatch.setattr(peers, "VllmOwnRunner", DyingVllmDouble)
    monkeypatch.setattr(DyingVllmDouble, "closed", [])
    results, _ = run_bench(tiny_model_dir, ["native", "vllm-generate:fp32", "vllm-generate:fp32:default"], [2],
                           ["greedy"], new_tokens=2, speculative_k=0, log=lambda line: None,
                           native_variants=("default",))
    by = {m.engine: m for m in results}
    assert by["vllm-generate:fp32"].cores == by["native:default"].cores == peers.this_process_cores()
    assert by["vllm-generate:fp32:default"].cores.startswith("vLLM's default")
    assert by["native:default"].dtype in ("float32", "bfloat16")


class DyingVllmDouble:
    """A test double for the vLLM peer (peers.VllmOwnRunner) that dies as vLLM 0.32 on CPU does on seeded
    sampled rows: greedy runs give every prompt its tokens; the first sampled run raises, and so does
    every call after it, closing included (a dead engine core)."""

    closed: list[str] = []  # the dtypes closed, across instances (each test sets its own list)

    def __init__(self, model_dir, dtype, max_batch, max_len, kv_bytes, cores=None):
        self.dead, self.dtype, self.cores = False, dtype, cores

    def run(self, prompt_ids, batch, new_tokens, temperature=0.0, top_p=1.0):
        if self.dead or temperature > 0:
            self.dead = True
            raise RuntimeError("vLLM's engine core died (test double)")
        return {"tokens": len(prompt_ids) * new_tokens, "seconds": 0.01, "outputs": [[1] * new_tokens] * len(prompt_ids)}

    def close(self):
        DyingVllmDouble.closed.append(self.dtype)
        if self.dead:
            raise RuntimeError("engine core is gone (test double)")


def test_a_peer_that_dies_is_reported_and_the_bench_goes_on(tiny_model_dir, monkeypatch):
    """An outside peer run as its users run it can die of its own bugs: the bench reports where and
    what it raised, keeps the cells it measured before (with their real number of repeats), and still
    prints its table; batchgen's own engines are measured in full."""
    import sys
    import types

    from batchgen.benchmarks import peers

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # "installed"; the double stands in for it
    monkeypatch.setattr(peers, "VllmOwnRunner", DyingVllmDouble)
    monkeypatch.setattr(DyingVllmDouble, "closed", [])  # a dead peer is still closed
    lines = []
    results, conditions = run_bench(tiny_model_dir, ["native", "vllm-generate"], [2], ["greedy", "sampled"],
                                    new_tokens=2, speculative_k=0, log=lines.append, repeats=2,
                                    native_variants=("eager",))
    grid = {(m.engine, m.mode): m for m in results}
    assert grid[("native", "greedy")].repeats == grid[("native", "sampled")].repeats == 2
    failed = conditions["peers_failed"]
    assert set(failed) == {"vllm-generate:fp32", "vllm-generate:bf16"}
    assert all(why.startswith("measuring batch 2 sampled: RuntimeError: vLLM's engine core died") for why in failed.values())
    for name in failed:  # its first repeat ran greedy first or sampled first (modes alternate): at most that greedy cell
        kept = [m for (engine, _), m in grid.items() if engine == name]
        assert all(m.mode == "greedy" and m.repeats == 1 and m.spread is None for m in kept)
        assert any(line.startswith(f"{name} failed, left out of the rest of this run") for line in lines)
    text = format_bench(results, conditions)
    assert "peers that failed in this run" in text and "targets (this run):" in text
    assert "vllm-generate:bf16, measuring batch 2 sampled: RuntimeError" in text
    assert sorted(DyingVllmDouble.closed) == ["bfloat16", "float32"]  # and the first failure is the one kept
    assert any(line.endswith("(closing: RuntimeError: engine core is gone (test double))") for line in lines)


def test_vllm_generate_runs_one_dtype_when_named_with_it(tiny_model_dir, monkeypatch):
    """`vllm-generate:fp32` starts and measures vLLM's float32 engine only (on a CPU without bf16 math
    its bf16 crawls); a dtype it does not know is refused before anything starts. Each cell records the
    prompt tokens a prefix cache served, and the bench warns where any were (none for native here)."""
    import sys
    import types

    from batchgen.benchmarks import peers

    class ServedVllmDouble(DyingVllmDouble):  # a peer that reports prompt tokens from its prefix cache
        def run(self, *args, **kwargs):
            return {**super().run(*args, **kwargs), "cached_prompt_tokens": 32}

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # "installed"; the double stands in for it
    monkeypatch.setattr(peers, "VllmOwnRunner", ServedVllmDouble)
    monkeypatch.setattr(DyingVllmDouble, "closed", [])
    lines = []
    results, _ = run_bench(tiny_model_dir, ["native", "vllm-generate:fp32"], [2], ["greedy"], new_tokens=2,
                           speculative_k=0, log=lines.append, native_variants=("eager",))
    assert sorted({(m.engine, m.dtype) for m in results}) == [("native", "float32"), ("vllm-generate:fp32", "float32")]
    assert DyingVllmDouble.closed == ["float32"]
    assert {m.engine: m.cached_prompt_tokens for m in results} == {"native": 0, "vllm-generate:fp32": 32}
    assert [line for line in lines if "WARNING" in line] == [
        "  WARNING: vllm-generate:fp32 batch 2: 32 prompt tokens came from its prefix cache"]
    with pytest.raises(ValueError, match="unknown engine 'vllm-generate:fp16'"):
        run_bench(tiny_model_dir, ["native", "vllm-generate:fp16"], [2], ["greedy"], new_tokens=2, speculative_k=0,
                  log=lambda line: None, native_variants=("eager",))


def test_llama_cpp_runs_the_shipped_gguf_as_a_peer(real_model_dir):
    """The llama.cpp peer on the model's own GGUF (where llama-cpp-python is installed: the `peers`
    extra, which neither set-up nor CI builds): greedy tokens in llama.cpp's own loop, one KV stream
    per sequence, every step timed; its tokens agree with batchgen's on the same weights."""
    from batchgen.benchmarks import peers

    why = peers.llama_cpp_available()
    if why:
        pytest.skip(f"{why}; pip install '.[peers]' to run it")
    from batchgen.benchmarks.bench import held_prompts
    from batchgen.benchmarks.bench_results import agreement
    from batchgen.config import SamplingParams
    from batchgen.model.tokenizer import Tokenizer

    from conftest import engine_tokens

    tok = Tokenizer(real_model_dir)
    texts = held_prompts(3)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    runner = peers.LlamaCppRunner(sorted(real_model_dir.glob("*.gguf"))[0], 3, 512, 2)
    try:
        got = runner.run(prompts, 3, 8)
    finally:
        runner.close()
    assert got["tokens"] == 24 and got["prefill_tokens"] == sum(map(len, prompts))
    assert len(got["decode_steps"]) == 7 and len(got["gaps"]) == 21 and got["decode_s"] > 0
    ours, _ = engine_tokens(real_model_dir, [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts],
                            SamplingParams(max_tokens=8, ignore_eos=True), dtype="float32", max_num_seqs=3,
                            max_model_len=512, compile="off")
    # llama.cpp quantizes activations to 8 bits for its Q4_1 products; the first tokens still agree
    assert agreement([ours[str(i)] for i in range(3)], got["outputs"]) >= 0.5


def test_the_step_profiler_splits_each_phase_into_classes(tiny_model_dir):
    """python -m batchgen.benchmarks.profile on the tiny model: both phases measured, every class's share
    between 0 and 1 and the shares summing to 1; and the op names land in the classes they should. The
    prompts take several prefill steps, and every decode step still runs all the batch's rows (the
    rows admitted first decode during the later prefill steps and must not finish before the decode phase)."""
    from batchgen.benchmarks import profile

    assert profile.classify("batchgen_gemv::gemv") == profile.classify("aten::addmm") == "GEMM"
    assert profile.classify("batchgen_bgemm::bgemm") == "GEMM"
    assert profile.classify("batchgen_attention::paged") == "attention"
    assert profile.classify("aten::argmax") == profile.classify("batchgen_sample::sample") == "sampling"
    assert profile.classify("aten::index_select") == "other ops"
    assert all(profile.classify(k) == "fused elementwise" for k in ("batchgen_rmsnorm::rms_norm", "batchgen_rope::rope",
                                                                   "batchgen_act::silu_mul"))
    assert profile.classify("batchgen_rmsnorm::rms_norm") == "fused elementwise"
    row = profile.profile_batch(tiny_model_dir, 48, decode_steps=3, compile_="off", ops=5)
    assert set(row["phases"]) == {"prefill", "decode"}
    assert row["phases"]["prefill"]["steps"] > 2
    assert row["phases"]["decode"]["steps"] == 3 and row["phases"]["decode"]["tokens"] == 3 * 48
    for phase in row["phases"].values():
        assert phase["steps"] > 0 and phase["wall_s"] > 0
        assert set(phase["shares"]) == set(profile.CLASSES) and all(0 <= v <= 1 for v in phase["shares"].values())
        assert abs(sum(phase["shares"].values()) - 1) < 1e-9
    assert row["phases"]["decode"]["shares"]["GEMM"] > 0 and row["phases"]["decode"]["shares"]["attention"] > 0
    assert "GEMM" in profile.format_rows([row])
    top = row["phases"]["prefill"]["ops"]  # --ops: the phase's ops by own time, most first
    assert 0 < len(top) <= 5 and [t[2] for t in top] == sorted((t[2] for t in top), reverse=True)
    assert "batch 48 prefill: the ops with the most own time" in profile.format_rows([row])


def test_the_targets_judge_each_engine_against_its_peer_in_the_same_dtype():
    """targets() on figures made up for the purpose: vLLM through batchgen against vLLM's generate in
    its own dtype (0.95x), the native engine against it (1.2x), batch 1 against llama.cpp (1.0x)."""
    from batchgen.benchmarks.bench_results import Measurement, targets

    def cell(engine, dtype, batch, tok_s, decode=None):
        return Measurement(section="grid", engine=engine, dtype=dtype, batch=batch, mode="greedy", workload="held",
                           speculative_k=0, prompts=batch, tokens=int(tok_s * 10), seconds=10.0,
                           decode_tok_per_s=decode)

    lines = "\n".join(targets([
        cell("vllm-generate:fp32", "float32", 64, 100.0), cell("vllm-generate:bf16", "bfloat16", 64, 200.0),
        cell("vllm", "float32", 64, 96.0), cell("vllm", "bfloat16", 64, 180.0),
        cell("native:auto", "bfloat16", 64, 250.0), cell("native:compiled", "float32", 64, 110.0),
        cell("llama.cpp", "Q4_1", 1, 90.0, decode=100.0), cell("native:auto", "float32", 1, 95.0, decode=105.0)]))
    assert "batch 64 float32 greedy, batchgen --engine vllm / vLLM's generate: 0.96x (target 0.95x) met" in lines
    assert "batch 64 bfloat16 greedy, batchgen --engine vllm / vLLM's generate: 0.90x (target 0.95x) MISSED" in lines
    assert "batch 64 bfloat16 greedy, native:auto (not the default: --dtype bfloat16) / vLLM's generate: 1.25x" in lines
    judged = "\n".join(targets([cell("vllm-generate:fp32", "float32", 64, 100.0),
                                cell("native:default", "float32", 64, 115.0), cell("native:compiled", "float32", 64, 130.0)]))
    assert "batch 64 float32 greedy, native:default / vLLM's generate: 1.15x (target 1.2x) MISSED" in judged
    # the row judged is generate's default flags; where it runs another dtype, the best native row in the
    # peer's dtype, with the flag that differs named
    assert ("batch 64 float32 greedy, native:compiled (not the default: --dtype float32) / vLLM's generate: 1.10x "
            "(target 1.2x) MISSED") in lines
    assert "batch 1 decode, native:auto (float32) / llama.cpp Q4_1: 1.05x (target 1.0x) met" in lines
    # where no native row ran in a peer's dtype (bf16 on an AVX2 CPU: auto takes float32), auto is judged
    # against it, and the line says which dtype auto took
    lines = "\n".join(targets([cell("vllm-generate:bf16", "bfloat16", 256, 40.0),
                               cell("native:auto", "float32", 256, 240.0)]))
    assert ("batch 256 bfloat16 greedy: no native row in bfloat16 (--dtype auto takes float32 on this CPU); "
            "native:auto / vLLM's generate in bfloat16: 6.00x (target 1.2x) met") in lines
