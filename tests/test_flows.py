"""Prefect flows in a test harness: generate, report artifacts, pipeline, sweep, parameter schema."""

import os

import pytest

from conftest import read_run_table, write_prompts

pytestmark = pytest.mark.heavy  # starts vLLM, a Prefect server or a Ray cluster: not in `make test-fast`


@pytest.fixture(autouse=True)
def _harness(prefect_harness):
    """Every test here runs against the session's Prefect test harness."""


def settings_for(tmp_path, model, **kw):
    from batchgen.settings import GenerateSettings

    inp = write_prompts(tmp_path / "in.parquet", [f"question {i}?" for i in range(7)] + [""],
                        ids=[f"f{i}" for i in range(8)])
    base = dict(input=[str(inp)], output=str(tmp_path / "runs"), model=str(model), max_tokens=3,
                max_model_len=64, max_num_seqs=2, shard_size=3)
    return GenerateSettings(**{**base, **kw})


def ids_in(run_dir):
    out = []
    for t in ("requests", "errors"):
        out += read_run_table(run_dir, t).column("id").to_pylist()
    return sorted(out)


def test_generate_flow_runs_one_task_per_shard_and_resumes(tmp_path, tiny_model_dir):
    from flows.generate import generate

    s = settings_for(tmp_path, tiny_model_dir, run_id="flow1")
    result = generate(s)
    assert result["rows"] == 8 and result["ok"] == 7 and result["errors"] == 1 and result["shards"] == 3
    assert ids_in(result["run_dir"]) == [f"f{i}" for i in range(8)]
    again = generate(s)  # a re-run of the same run id does no work and loses nothing
    assert again["rows"] == 8 and ids_in(again["run_dir"]) == ids_in(result["run_dir"])


def test_generate_flow_reuses_earlier_runs_and_says_so(tmp_path, tiny_model_dir):
    """The nightly shape: the same rows again, with the output root as --reuse-from: nothing is generated
    twice, and the run's artifact counts generated, reused and error rows."""
    import json

    import anyio
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter

    from flows.generate import ROWS_KEY, generate

    first = generate(settings_for(tmp_path, tiny_model_dir, run_id="night1"))
    assert first["reused"] == 0
    second = generate(settings_for(tmp_path, tiny_model_dir, run_id="night2", reuse_from=[str(tmp_path / "runs")]))
    assert second["ok"] == second["reused"] == 7 and second["errors"] == 1

    async def latest():
        async with get_client() as client:
            return await client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(key={"any_": [ROWS_KEY]}))

    (art,) = anyio.run(latest)
    data = art.data if isinstance(art.data, list) else json.loads(art.data)
    assert data == [{"run": "night2", "rows": 8, "generated": 0, "reused": 7, "errors": 1, "shards": 3}]


def test_report_flow_publishes_artifacts_under_stable_keys(tmp_path, tiny_model_dir):
    from prefect.client.orchestration import get_client

    from flows.generate import generate
    from flows.report import HEADLINE_KEY, LATENCY_KEY, REPORT_LINK_KEY, report

    run = generate(settings_for(tmp_path, tiny_model_dir, run_id="rep"))
    out = report([run["run_dir"]])
    assert (tmp_path / "runs" / "rep" / "report" / "report.html").is_file()
    (row,) = out["headline"]
    assert row["requests"] == 7 and row["output_tok_per_s"] > 0 and row["max_num_seqs"] == 2
    assert row["model"] == str(tiny_model_dir) and row["engine"] == "native"

    import anyio
    from prefect.client.schemas.filters import ArtifactCollectionFilter

    async def latest(key):
        async with get_client() as client:
            return await client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(key={"any_": [key]}))

    for key, kind in ((HEADLINE_KEY, "table"), (LATENCY_KEY, "markdown"), (REPORT_LINK_KEY, "markdown")):
        (art,) = anyio.run(latest, key)
        assert art.type == kind
    (md,) = anyio.run(latest, LATENCY_KEY)
    assert "ttft_s" in md.data and "p99_s" in md.data


def test_pipeline_and_sweep(tmp_path, tiny_model_dir):
    from flows.pipeline import pipeline
    from flows.sweep import sweep

    result = pipeline(settings_for(tmp_path, tiny_model_dir, run_id="pipe"))
    assert result["rows"] == 8 and os.path.isfile(os.path.join(result["report"], "report.html"))
    curve = sweep(settings_for(tmp_path, tiny_model_dir, run_id="sw"), max_num_seqs=[1, 3], sample_rows=5,
                  price_per_hour=2.0)["curve"]
    assert [r["max_num_seqs"] for r in curve] == [1, 3]
    assert all(r["requests"] + r["errors"] == 5 for r in curve)
    assert any(r["on_frontier"] for r in curve) and all(r["cost_per_million_output_tokens"] > 0 for r in curve)


def test_every_form_field_is_described():
    """The UI renders each parameter's description under its title: none may be missing."""
    from prefect.utilities.callables import parameter_schema

    from flows.generate import generate
    from flows.pipeline import pipeline
    from flows.report import report
    from flows.sweep import sweep

    for fl in (generate, pipeline, report, sweep):
        schema = parameter_schema(fl).model_dump()
        models = [schema, *schema.get("definitions", {}).values()]
        missing = [(fl.name, name) for m in models for name, prop in m.get("properties", {}).items()
                   if not prop.get("description")]
        assert missing == []


def test_parameter_schema_shows_a_form():
    from prefect.utilities.callables import parameter_schema

    from flows.generate import generate

    schema = parameter_schema(generate).model_dump()
    settings = schema["definitions"]["GenerateSettings"]
    props = settings["properties"]
    assert settings["required"] == ["input"]
    assert props["engine"]["enum"] == ["native", "vllm"] and props["engine"]["default"] == "native"
    assert props["max_num_seqs"]["minimum"] == 1 and props["max_num_seqs"]["default"] == 32
    assert props["too_long"]["enum"] == ["error", "truncate"]
    assert props["temperature"]["title"] and props["input"]["description"]
    assert {"input", "model", "max_tokens", "shard_size", "output", "run_id", "top_p"} <= set(props)


def test_bad_parameters_are_rejected_before_any_work(tmp_path):
    from prefect.exceptions import ParameterTypeError

    from flows.generate import generate

    bad = {"input": [str(tmp_path / "x.parquet")], "output": str(tmp_path / "runs"), "max_num_seqs": 0}
    with pytest.raises((ParameterTypeError, ValueError)):
        generate(settings=bad)
    assert not (tmp_path / "runs").exists()


class FlakyEngineDouble:
    """Test double: wraps a real engine and dies on its 3rd step, once per process, like a crashed core."""

    failures_left = 1

    def __init__(self, real):
        self.real, self.steps = real, 0
        self.tokenizer, self.max_model_len = real.tokenizer, real.max_model_len

    def __getattr__(self, name):
        return getattr(self.real, name)

    def step(self):
        self.steps += 1
        if self.steps == 3 and FlakyEngineDouble.failures_left:
            FlakyEngineDouble.failures_left -= 1
            from batchgen.engine import EngineDead

            raise EngineDead("engine core died (test double)")
        return self.real.step()


def test_a_dying_engine_fails_the_shard_which_is_retried_and_resumed(tmp_path, tiny_model_dir, monkeypatch):
    import flows.generate as flows_generate
    from batchgen.engine import create_engine
    from batchgen.worker import Worker
    from flows.generate import generate

    created = []

    def create(*a, **kw):
        engine = FlakyEngineDouble(create_engine(*a, **kw))
        created.append(engine)
        return engine

    # the flow process's worker, as a fresh process has it (no engine loaded), making doubles
    worker = Worker(create=create)
    monkeypatch.setattr(flows_generate, "process_worker", lambda: worker)
    result = generate(settings_for(tmp_path, tiny_model_dir, run_id="flaky"))
    assert FlakyEngineDouble.failures_left == 0 and len(created) == 2  # the retry got a fresh engine
    assert result["rows"] == 8 and ids_in(result["run_dir"]) == [f"f{i}" for i in range(8)]


def test_the_demo_entry_point_prints_the_headline(tmp_path, tiny_model_dir, capsys):
    """`make demo` runs `python -m flows.pipeline --config ...`: the same main, on a small config."""
    import yaml

    from flows.pipeline import main

    s = settings_for(tmp_path, tiny_model_dir)
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(yaml.safe_dump({**s.model_dump(), "progress": False}))
    main(["--config", str(cfg), "--run-id", "demo"])
    out = capsys.readouterr().out
    for title in ("Throughput", "Request latency", "KV cache", "Run conditions"):
        assert title in out
    assert "report: " in out and (tmp_path / "runs" / "demo" / "report" / "report.html").is_file()


def test_a_flow_past_its_budget_stops_without_retrying_and_resumes(tmp_path, tiny_model_dir, monkeypatch):
    """--max-hours in the flow: every shard task gets the run's one deadline; past it the task stops,
    is not retried (a retry could only stop again), the flow fails with the line that says how far it
    got, and the same run without the cap completes, every id once."""
    import flows.generate as flows_generate
    from batchgen import budget
    from flows.generate import generate

    calls = []
    real = flows_generate.run_shard_in_worker

    def counted(*a, **kw):
        calls.append(a[2])
        return real(*a, **kw)

    monkeypatch.setattr(flows_generate, "run_shard_in_worker", counted)
    s = settings_for(tmp_path, tiny_model_dir, run_id="capped", max_hours=1e-9)  # spent before the first shard
    with pytest.raises(budget.BudgetReached, match=r"--max-hours 1e-09\): 0 of 3 shards are committed \(0 of 8 rows\)"):
        generate(s)
    assert calls[0] == 0 and calls.count(0) == 1  # the task that hit the budget ran once: no retry
    result = generate(s.model_copy(update={"max_hours": None}))
    assert result["rows"] == 8 and ids_in(result["run_dir"]) == [f"f{i}" for i in range(8)]
