"""One conformance suite, run against both engines on the real model: the same schema, the same
invariants, the same error handling, and how often greedy outputs agree token for token.

vLLM starts here with enforce_eager (about 30 s; its compiled CPU path, batchgen's default, takes about
80 s and is measured by batchgen.benchmarks.vllm_wrapper); that batchgen starts vLLM with vLLM's own
defaults is checked with a test double in place of vLLM's LLMEngine."""

import pyarrow.parquet as pq
import pytest

from batchgen.config import EngineConfig, RunConfig, SamplingParams
from batchgen.data.writer import SCHEMAS
from batchgen.engine import RequestRejected
from batchgen.runner import generate
from batchgen.worker import Worker

from conftest import TEST_DATA, cli_args, read_run_table, run_cli_subprocess, skip_or_fail, write_prompts

pytestmark = pytest.mark.heavy  # starts vLLM, a Prefect server or a Ray cluster: not in `make test-fast`

ENGINES = ["native", "vllm"]
EAGER = (("enforce_eager", True),)  # vLLM's eager mode: a faster start for tests
N_PROMPTS = 16
# the runs fixture's engine settings, which the tests that reuse its vLLM engine give again (a vLLM start
# costs ~30 s); a step's budget of one whole prompt (vLLM on CPU takes no prompt split across steps)
CONFIG = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def workers():
    """One worker per engine for the module, as a process keeps one: each engine loads once, with the
    runs fixture's settings, and is reused by the tests that follow (a vLLM start costs ~30 s, and one
    worker switching engines would restart vLLM each time). Tests that need other engine settings
    (speculation, adapters) take their own worker."""
    ws = {engine: Worker() for engine in ENGINES}
    yield ws
    for w in ws.values():
        if w.engine is not None:
            w.drop_engine(w.engine)


@pytest.fixture
def own_worker():
    """A worker for one test's own engine settings, closed after it."""
    w = Worker()
    yield w
    if w.engine is not None:
        w.drop_engine(w.engine)


class Runs(dict):
    """engine -> (summary, run dir); an engine that could not run here skips its tests on a laptop and
    fails them in CI (BATCHGEN_REQUIRE_VLLM=1), while the other engine's tests still run."""

    def __missing__(self, engine):
        skip_or_fail(f"the {engine} engine does not import here: {self.why}", "BATCHGEN_REQUIRE_VLLM")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, workers):
    """Each engine generates the same dataset once (vLLM starts in ~30 s, so the runs are shared)."""
    out = Runs()
    try:
        import vllm  # noqa: F401
        engines = ENGINES
    except ImportError as e:
        out.why = f"{e} (the cpu extra installs it: make setup)"
        engines = ["native"]
    root = tmp_path_factory.mktemp("conformance")
    seed = pq.read_table(TEST_DATA / "alpaca_seed_prompts.parquet").slice(0, N_PROMPTS)
    too_long = {"id": "too-long", "prompt": "lorem ipsum " * 400}
    empty = {"id": "empty", "prompt": "  "}
    rows = seed.to_pylist() + [too_long, empty]
    for i, r in enumerate(rows):  # per-row features ride along: both engines get the same requests
        r["system"] = "Answer in one sentence." if i % 5 == 1 else None
        r["stop"] = ["."] if i % 5 == 2 else None
        r["source"] = f"src-{i % 3}"
    inp = root / "in.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist(rows), inp)
    for engine in engines:
        cfg = RunConfig(inputs=(str(inp),), output_dir=str(root), run_id=engine, engine=engine, shard_size=7,
                        engine_config=CONFIG,
                        engine_options=EAGER if engine == "vllm" else (),
                        sampling=SamplingParams(max_tokens=24, logprobs=2), keep_columns=("source",),
                        progress=False)
        summary = generate(cfg, probe=False, worker=workers[engine])
        out[engine] = (summary, root / engine)
    return out


def tables(run_dir):
    return {t: read_run_table(run_dir, t) for t in SCHEMAS}


def module_vllm(runs, workers):
    """The vLLM engine the runs fixture left loaded (the same settings: no new start); skips (fails in CI)
    where vLLM does not import."""
    from batchgen.model.prepare import resolve_model

    runs["vllm"]
    cfg = RunConfig(inputs=("x",), output_dir="x", engine="vllm", engine_options=EAGER, engine_config=CONFIG)
    return workers["vllm"].load_engine(cfg, resolve_model(cfg.model))


@pytest.mark.parametrize("engine", ENGINES)
def test_same_schema(runs, engine):
    t = tables(runs[engine][1])
    for name, schema in SCHEMAS.items():
        assert t[name].select(schema.names).schema == schema, name
    assert {r["source"] for r in t["requests"].to_pylist() + t["errors"].to_pylist()} == {"src-0", "src-1", "src-2"}


def test_same_seeds_stops_and_logprobs_on_both_engines(runs):
    """Seeds are derived before the engine; a row's stop ends it on either engine; logprobs agree."""
    native, vllm = (tables(runs[e][1]) for e in ENGINES)
    for t in (native, vllm):
        req = {r["id"]: r for r in t["requests"].to_pylist()}
        stopped = [r for r in req.values() if r["finish_reason"] == "stop" and "." not in r["text"]]
        assert stopped  # rows with stop ["."] ended there, the stop string cut from the text
        assert all(tok["logprob"] is not None and len(tok["top_logprobs"]) == 2 for tok in t["tokens"].to_pylist())
    seeds = [{r["id"]: r["seed"] for r in t["requests"].to_pylist()} for t in (native, vllm)]
    assert seeds[0] == seeds[1] and None not in seeds[0].values()
    n_tok = {(x["request_id"], x["token_index"]): x for x in native["tokens"].to_pylist()}
    close = same = 0
    for x in vllm["tokens"].to_pylist():
        y = n_tok.get((x["request_id"], x["token_index"]))
        if y is None or y["token_id"] != x["token_id"]:
            continue
        same += 1
        close += abs(x["logprob"] - y["logprob"]) < 1e-2 and [a["token_id"] for a in x["top_logprobs"]] == \
            [a["token_id"] for a in y["top_logprobs"]]
    print(f"\nlogprobs: {close} of {same} shared tokens agree within 1e-2 with the same top-2")
    assert same > 50 and close / same > 0.9


@pytest.mark.parametrize("engine", ENGINES)
def test_same_invariants(runs, engine):
    summary, run_dir = runs[engine]
    assert (run_dir / "_SUCCESS").is_file() and summary.rows == N_PROMPTS + 2
    t = tables(run_dir)
    req, tok = t["requests"].to_pylist(), t["tokens"].to_pylist()
    ids = [r["id"] for r in req] + t["errors"].column("id").to_pylist()
    assert len(ids) == len(set(ids)) == N_PROMPTS + 2  # every row once
    assert len(req) == N_PROMPTS
    by_req = {}
    for row in tok:
        by_req.setdefault(row["request_id"], []).append(row)
    for r in req:
        assert r["output_tokens"] == len(r["output_token_ids"]) > 0  # counts match the ids
        assert r["enqueue_t"] <= r["schedule_t"] <= r["first_token_t"] <= r["last_token_t"]
        rows = sorted(by_req[r["id"]], key=lambda x: x["token_index"])
        assert [x["token_index"] for x in rows] == list(range(r["output_tokens"]))
        assert [x["token_id"] for x in rows] == r["output_token_ids"]
        times = [x["t"] for x in rows]
        assert times == sorted(times)  # timestamps increase within a request
        assert times[0] == pytest.approx(r["first_token_t"]) and times[-1] == pytest.approx(r["last_token_t"])
        assert [x["context_len"] for x in rows] == [r["prompt_tokens"] + i for i in range(r["output_tokens"])]
        assert (rows[0]["itl_s"] is None) and all(x["itl_s"] >= 0 for x in rows[1:])
    steps = t["steps"].to_pylist()
    assert all(s["end_t"] >= s["start_t"] and s["num_running"] >= 1 for s in steps)
    assert max(s["num_running"] for s in steps) <= 4


@pytest.mark.parametrize("engine", ENGINES)
def test_same_error_handling(runs, engine):
    errors = {e["id"]: e for e in tables(runs[engine][1])["errors"].to_pylist()}
    assert set(errors) == {"too-long", "empty"}
    assert "max_model_len 512" in errors["too-long"]["error"] and "prompt is empty" in errors["empty"]["error"]


def test_vllm_rejects_a_request_it_cannot_take_as_a_row_error(runs, workers):
    engine = module_vllm(runs, workers)
    with pytest.raises(RequestRejected, match="maximum context length is 512"):
        engine.add("direct", list(range(10, 700)), SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()


def test_a_prompt_run_again_is_served_by_vllms_prefix_cache_until_it_is_emptied(runs, workers):
    """vLLM keeps its prefix cache on by default, so the same prompts sent again (a benchmark's warm-up
    and repeats) are served, not computed; VllmEngine.reset_prefix_cache empties it, which the
    benchmarks do before each run (batchgen.benchmarks.peers and vllm_wrapper)."""
    from batchgen.benchmarks.bench import run_engine

    engine = module_vllm(runs, workers)
    prompts = [[1 + (7 * i + j) % 4000 for j in range(300)] for i in range(3)]  # whole blocks (128 on CPU)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.reset_prefix_cache()
    first = run_engine(engine, prompts, 3, params, None, "p1")
    again = run_engine(engine, prompts, 3, params, None, "p2")
    engine.reset_prefix_cache()
    emptied = run_engine(engine, prompts, 3, params, None, "p3")
    assert first["cached_prompt_tokens"] == 0 == emptied["cached_prompt_tokens"]
    assert again["cached_prompt_tokens"] >= 3 * 128  # each prompt's whole blocks
    assert [len(o) for o in again["outputs"]] == [2, 2, 2]


def test_vllm_on_cpu_samples_seeded_rows_whose_prompts_take_several_steps(runs, workers):
    """More prompt tokens than a step's budget, sampled rows with seeds: vLLM 0.32's engine core died on
    CPU when it split a prompt across steps (it rewinds a seeded row's generator by an offset that only
    CUDA's generator has). batchgen starts it on CPU with whole prompts a step: every row completes, and
    a row's seeded tokens are the same when the rows come in the other order. On the module's engine (a
    512-token budget: two of these prompts a step, where chunked prefill would split the third)."""
    from test_engine import run_all

    e = module_vllm(runs, workers)
    assert e.options["enable_chunked_prefill"] is False and e.options["max_num_batched_tokens"] == 512
    rows = {f"r{i}": list(range(1000 + 7 * i, 1200 + 9 * i)) for i in range(8)}  # 200-214 tokens: 1,656 in all
    outputs = []
    for order in (list(rows), list(rows)[::-1]):
        for rid in order:
            e.add(rid, rows[rid], SamplingParams(max_tokens=6, temperature=0.8, seed=int(rid[1:]), ignore_eos=True))
        steps, done = run_all(e)
        assert len(steps) > 6 + 1 and all(len(done[r].output_token_ids) == 6 for r in rows)
        prefills = [s.num_prefill_tokens for s in steps if s.num_prefill_tokens]
        # every prompt token computed once. The budget (512, whole prompts: asserted above) splits these 1,656
        # tokens over at least four of the core's steps; how many of batchgen's steps they show in is timing:
        # vLLM's core runs in its own process, and on a loaded machine one step() gathered two (CI, 2026-12-07)
        assert sum(prefills) == sum(map(len, rows.values())), prefills
        outputs.append({r: done[r].output_token_ids for r in rows})
    assert outputs[0] == outputs[1]


def test_greedy_outputs_match_between_engines(runs):
    native = {r["id"]: r["output_token_ids"] for r in tables(runs["native"][1])["requests"].to_pylist()}
    vllm = {r["id"]: r["output_token_ids"] for r in tables(runs["vllm"][1])["requests"].to_pylist()}
    same = sum(native[k] == vllm[k] for k in native)
    rate = same / len(native)
    print(f"\nnative vs vLLM, fp32 greedy, {len(native)} prompts x 24 tokens: {same} identical ({rate:.0%})")
    assert rate >= 0.75


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_json_schema_output_validates_on_12_rows(tmp_path, runs, engine, workers):
    """Every output parses and validates against its schema (xgrammar natively, vLLM's structured outputs)."""
    import json

    import jsonschema

    from batchgen.data.response_format import normalise_response_format

    schema = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                               "topic": {"enum": ["food", "work", "science", "other"]},
                                               "question": {"type": "boolean"}},
              "required": ["sentiment", "topic", "question"], "additionalProperties": False}
    spec = normalise_response_format({"type": "json_schema", "json_schema": {"name": "label", "schema": schema}})
    rows = [r for r in pq.read_table(TEST_DATA / "alpaca_seed_prompts.parquet").to_pylist()
            if len(r["prompt"]) < 600][:12]  # prompts that fit max_model_len 512
    inp = tmp_path / "in.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist(rows), inp)
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(tmp_path), run_id=engine, engine=engine, shard_size=10,
                    engine_options=EAGER if engine == "vllm" else (),
                    engine_config=CONFIG,  # the fixture's: vLLM is reused
                    sampling=SamplingParams(max_tokens=48, structured=spec), progress=False)
    summary = generate(cfg, probe=False, worker=workers[engine])
    assert summary.rows == 12 and summary.errors == 0
    req = read_run_table(tmp_path / engine, "requests").to_pylist()
    assert len(req) == 12
    for r in req:
        jsonschema.validate(json.loads(r["text"]), schema)


@pytest.mark.parametrize("engine", ENGINES)
def test_n_samples_are_the_same_rows_with_the_same_seeds_on_both_engines(tmp_path, runs, engine, workers):
    from conftest import write_prompts

    inp = write_prompts(tmp_path / "in.parquet", ["Name a colour.", "Name a fruit.", "  "], ids=["c", "f", "empty"])
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(tmp_path), run_id=engine, engine=engine, n=3,
                    engine_options=EAGER if engine == "vllm" else (),
                    engine_config=CONFIG,  # the fixture's: vLLM is reused
                    sampling=SamplingParams(max_tokens=6, temperature=0.9), progress=False)
    generate(cfg, probe=False, worker=workers[engine])
    t = tables(tmp_path / engine)
    req = t["requests"].to_pylist()
    assert sorted((r["id"], r["sample_index"], r["num_samples"]) for r in req) == \
        [(i, k, 3) for i in ("c", "f") for k in range(3)]
    from batchgen.config import derive_seed

    for r in req:  # sample 0: the row's derived seed; the others derived from it, the same on either engine
        row_seed = derive_seed(0, r["id"])
        assert r["seed"] == (row_seed if r["sample_index"] == 0 else derive_seed(row_seed, f"sample-{r['sample_index']}"))
    (err,) = t["errors"].to_pylist()
    assert err["id"] == "empty" and err["sample_index"] is None
    assert {(x["request_id"], x["sample_index"]) for x in t["tokens"].to_pylist()} == \
        {(r["id"], r["sample_index"]) for r in req}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_looping_row_is_stopped_the_same_way_on_both_engines(tmp_path, runs, engine, workers):
    """The repetition rule (batchgen.engine.repetition) on both engines: a seed prompt the real model
    loops on ends with finish_reason 'repetition' well before max_tokens, its tokens a loop by the rule;
    a row that ends by itself is untouched."""
    from batchgen.engine.repetition import looping

    rows = [r for r in pq.read_table(TEST_DATA / "alpaca_seed_prompts.parquet").to_pylist()
            if r["id"] in ("seed_task_4", "seed_task_1")]
    inp = tmp_path / "in.parquet"
    pq.write_table(__import__("pyarrow").Table.from_pylist(rows), inp)
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(tmp_path), run_id=engine, engine=engine,
                    engine_options=EAGER if engine == "vllm" else (),
                    engine_config=CONFIG,  # the fixture's: vLLM is reused
                    sampling=SamplingParams(max_tokens=160), progress=False)
    summary = generate(cfg, probe=False, worker=workers[engine])
    req = {r["id"]: r for r in read_run_table(tmp_path / engine, "requests").to_pylist()}
    assert summary.looped == 1 and req["seed_task_4"]["finish_reason"] == "repetition"
    assert req["seed_task_4"]["output_tokens"] < 120 and looping(req["seed_task_4"]["output_token_ids"])
    assert req["seed_task_1"]["finish_reason"] == "stop"
    assert {t["request_id"] for t in read_run_table(tmp_path / engine, "tokens").to_pylist()} == set(req)


def test_dead_vllm_engine_fails_the_run_and_a_rerun_resumes(tmp_path, runs, workers):
    """Kill vLLM's engine-core process: the shard fails (no manifest, no _SUCCESS), the dead engine is
    dropped, and the same command resumes into a complete, exactly-once run with a fresh engine. It
    kills the module's vLLM engine, so it runs after the tests that share it, and closes the fresh one."""
    import psutil

    from batchgen.model.prepare import resolve_model

    inp = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(TEST_DATA / "alpaca_seed_prompts.parquet").slice(0, 6), inp)
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(tmp_path), run_id="dies", engine="vllm", shard_size=3,
                    engine_config=CONFIG,
                    sampling=SamplingParams(max_tokens=8), engine_options=EAGER, progress=False)
    worker = workers["vllm"]
    engine = worker.load_engine(cfg, resolve_model(cfg.model))  # the runs fixture's engine
    cores = [p for p in psutil.Process().children(recursive=True)
             if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    assert cores, "expected vLLM's engine core to run in a child process"
    for p in cores:
        p.kill()
    psutil.wait_procs(cores, timeout=30)
    with pytest.raises(Exception, match="engine core"):
        generate(cfg, probe=False, worker=worker)
    assert not (tmp_path / "dies" / "_SUCCESS").exists()
    assert worker.engine is not engine  # the dead engine was dropped: the rerun starts a fresh one
    summary = generate(cfg, probe=False, worker=worker)
    assert summary.resumed and summary.rows == 6 and summary.ok == 6
    ids = tables(tmp_path / "dies")["requests"].column("id").to_pylist()
    assert sorted(ids) == sorted(pq.read_table(inp).column("id").to_pylist())
    worker.drop_engine(worker.engine)  # no later test shares it: its memory and cores go back


def test_vllm_is_started_with_its_own_defaults(monkeypatch, real_model_dir):
    """batchgen forces no eager mode and starts vLLM in LLM(...)'s usage context, so that --engine vllm
    runs what LLM.generate runs (vLLM's compiled CPU path). A test double in place of vLLM's
    LLMEngine.from_engine_args records what it is given and refuses to start."""
    try:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as e:
        skip_or_fail(f"vllm does not import here: {e}", "BATCHGEN_REQUIRE_VLLM")
    from batchgen.engine.vllm import VllmEngine

    given = {}

    def from_engine_args_double(cls, args, usage_context=None, stat_loggers=None):
        given.update(args=args, usage_context=usage_context)
        raise RuntimeError("test double: not started")

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(from_engine_args_double))
    with pytest.raises(Exception, match="did not start"):
        VllmEngine(real_model_dir, EngineConfig(dtype="bfloat16", max_num_seqs=4, max_model_len=256))
    assert given["args"].enforce_eager is False and given["usage_context"] == UsageContext.LLM_CLASS
    with pytest.raises(Exception, match="did not start"):  # a user's own choice still goes through
        VllmEngine(real_model_dir, EngineConfig(dtype="bfloat16", max_num_seqs=4, max_model_len=256),
                   options={"enforce_eager": True})
    assert given["args"].enforce_eager is True


def test_vllm_options_are_checked_against_engine_args_before_any_work(tmp_path, capsys):
    """Every EngineArgs field passes; a typo gets the close matches; a key batchgen owns names its flag."""
    from batchgen.cli import main
    from batchgen.engine.vllm import check_vllm_options

    from conftest import write_prompts

    check_vllm_options({"enable_lora": True, "kv_cache_dtype": "auto", "trust_remote_code": False,
                        "pipeline_parallel_size": 1, "data_parallel_size": 1})  # the keys the old allowlist refused
    with pytest.raises(ValueError, match=r"'enable_prefix_cachin' is not a vllm EngineArgs field "
                                         r"\(did you mean 'enable_prefix_caching'"):
        check_vllm_options({"enable_prefix_cachin": True})
    with pytest.raises(ValueError, match=r"'max_num_seqs' is set by batchgen: use --max-num-seqs"):
        check_vllm_options({"max_num_seqs": 8})
    inp = write_prompts(tmp_path / "in.parquet", ["x"])
    assert main(["generate", "--engine", "vllm", "--input", str(inp), "--output", str(tmp_path / "runs"),
                 "--vllm-option", "seed=3", "--no-progress"]) == 2
    assert "'seed' is set by batchgen: use --seed" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made


def test_speculative_ngram_steps_emit_several_tokens_sharing_one_time(tmp_path, runs, own_worker):
    """n-gram speculation through speculative_config: a step may emit several tokens of a request;
    they share the step's time (token ITL 0), and the per-step ITL query sees through that."""
    from batchgen.report.queries import connect, run_query

    inp = tmp_path / "in.parquet"
    text = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
    pq.write_table(__import__("pyarrow").table({"messages": [f'[{{"role": "user", "content": "{text}"}}]'] * 2}),
                   inp)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(tmp_path), run_id="spec", engine="vllm",
                    engine_config=CONFIG,
                    sampling=SamplingParams(max_tokens=32),
                    engine_options=(("enforce_eager", True), ("speculative_config", spec)),
                    progress=False)
    generate(cfg, probe=False, worker=own_worker)
    t = tables(tmp_path / "spec")
    tok = t["tokens"].to_pylist()
    per_step = {}
    for row in tok:
        per_step.setdefault((row["request_id"], row["step_id"]), []).append(row)
    multi = [rows for rows in per_step.values() if len(rows) > 1]
    assert multi, "n-gram speculation should accept several tokens in some step"
    for rows in multi:
        assert len({r["t"] for r in rows}) == 1
        assert all(r["itl_s"] == 0 for r in sorted(rows, key=lambda r: r["token_index"])[1:])
    (row,) = run_query(connect([tmp_path / "spec"]), "itl_per_step").to_pylist()
    assert row["max_tokens_per_step"] > 1 and row["p50_s"] > 0


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory, real_model_dir):
    """A rank-4 LoRA adapter on the real model, random (not zero) weights, built with peft: no download."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapter") / "tiny"
    model.save_pretrained(out)
    return out


@pytest.mark.slow
def test_lora_adapter_per_row_on_vllm_and_a_clear_error_on_native(tmp_path, tiny_adapter, own_worker):
    from conftest import write_prompts

    prompts = ["Name a colour.", "Name a fruit.", "Name a city."]
    inp = write_prompts(tmp_path / "in.parquet", prompts * 2 + ["Name a river."],
                        ids=["a0", "a1", "a2", "b0", "b1", "b2", "unknown"],
                        lora=["tiny"] * 3 + [None] * 3 + ["nope"])
    common = dict(inputs=(str(inp),), output_dir=str(tmp_path), shard_size=10, progress=False,
                  engine_config=EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=256), sampling=SamplingParams(max_tokens=8),
                  lora_adapters=(("tiny", str(tiny_adapter)),))
    generate(RunConfig(**common, engine="vllm", run_id="vllm", engine_options=EAGER), probe=False, worker=own_worker)
    t = tables(tmp_path / "vllm")
    out = {r["id"]: r["output_token_ids"] for r in t["requests"].to_pylist()}
    errors = {e["id"]: e["error"] for e in t["errors"].to_pylist()}
    assert "lora 'nope' is not an adapter of this run (adapters: tiny)" in errors["unknown"]
    assert sum(out[f"a{i}"] != out[f"b{i}"] for i in range(3)) >= 2  # the adapter changes what the model says
    generate(RunConfig(**common, engine="native", run_id="native"), probe=False, worker=own_worker)
    t = tables(tmp_path / "native")
    errors = {e["id"]: e["error"] for e in t["errors"].to_pylist()}
    assert all("the native engine runs no adapters; use --engine vllm" in errors[f"a{i}"] for i in range(3))
    assert sorted(r["id"] for r in t["requests"].to_pylist()) == ["b0", "b1", "b2"]


def test_vllm_runs_a_family_the_native_engine_refuses(tmp_path, real_model_dir):
    """vLLM reads the model itself: an architecture the native engine refuses (Granite, here the real
    model's weights under Granite's config with unit multipliers) runs."""
    import json
    import shutil

    from batchgen.config import EngineConfig, SamplingParams
    from batchgen.engine.vllm import VllmEngine
    from batchgen.model.loader import ModelLoadError, read_model_config

    d = tmp_path / "model"
    shutil.copytree(real_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "granite", "architectures": ["GraniteForCausalLM"],
                                               "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                                               "attention_multiplier": 0.125, "logits_scaling": 1.0}))
    with pytest.raises(ModelLoadError, match="Use --engine vllm"):
        read_model_config(d)
    engine = VllmEngine(d, EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=256),
                        options={"enforce_eager": True})
    try:
        engine.add("a", engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=4))
        done = []
        while engine.has_unfinished():
            done += engine.step().finished
        assert len(done) == 1 and len(done[0].output_token_ids) >= 1
    finally:
        engine.close()


@pytest.mark.slow
def test_cli_engine_vllm_in_a_fresh_process(tmp_path, runs):
    """The user's path: `batchgen generate --engine vllm` in a new process (vLLM spawns its engine core)."""
    import subprocess
    import sys

    from conftest import REPO, write_prompts

    inp = write_prompts(tmp_path / "in.parquet", ["Name a colour.", "Name a fruit.", "Name a city."])
    proc = subprocess.run([sys.executable, "-m", "batchgen.cli", "generate", "--engine", "vllm", "--input", str(inp),
                           "--output", str(tmp_path / "runs"), "--run-id", "v", "--max-tokens", "8",
                           "--max-model-len", "256", "--max-num-seqs", "2", "--no-progress",
                           "--vllm-option", "enable_prefix_caching=true", "--vllm-option", "enforce_eager=true"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 rows -> 3 outputs, 0 errors" in proc.stdout
    import json

    conditions = json.loads((tmp_path / "runs" / "v" / "run.json").read_text())["conditions"]["engine"]
    assert conditions["engine"] == "vllm" and conditions["vllm_options"]["enable_prefix_caching"] is True


def test_a_vllm_engine_that_fails_to_start_names_its_cause_on_the_last_line(tmp_path, tiny_model_dir):
    """vLLM's CPU attention refuses head_dim 16 (the tiny model's) in its worker process, which logs
    why; the parent only hears "EngineCore encountered an issue. See stack trace (above) for the root
    cause." batchgen's last line names the cause itself."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        skip_or_fail(f"vllm does not import here: {e}", "BATCHGEN_REQUIRE_VLLM")
    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    r = run_cli_subprocess(cli_args(inp, tmp_path / "runs", tiny_model_dir, "dies", "--engine", "vllm",
                                    "--vllm-option", "enforce_eager=true"))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("batchgen: error: vLLM's engine"), r.stderr[-3000:]
    assert "RuntimeError: Unsupported CPU attention configuration: head_dim=16" in last, last
    assert "stack trace" not in last, last
