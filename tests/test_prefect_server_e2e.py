"""End to end: a real `prefect server` on loopback, the deployments served by flows/serve.py, a run
started through the API with parameters the way the UI does, then its outputs and artifacts checked."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, prefect_server_env, read_run_table, write_prompts

pytestmark = pytest.mark.heavy  # starts vLLM, a Prefect server or a Ray cluster: not in `make test-fast`


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    with prefect_server_env(tmp_path_factory.mktemp("prefect-server-home"), ui=False) as env:
        yield env


def test_ui_style_run_of_the_on_demand_deployment(tmp_path, tiny_model_dir, prefect_server):
    env = prefect_server
    serve_log = open(tmp_path / "serve.log", "w")
    served = subprocess.Popen([sys.executable, "-m", "flows.serve"], env=env, cwd=REPO, stdout=serve_log,
                              stderr=subprocess.STDOUT)
    inp = write_prompts(tmp_path / "in.parquet", [f"what is {i} + {i}?" for i in range(5)],
                        ids=[f"e{i}" for i in range(5)])
    # what the UI's form posts: JSON parameters, validated against the deployment's schema
    parameters = {"settings": {"input": [str(inp)], "output": str(tmp_path / "runs"), "run_id": "ui-run",
                               "model": str(tiny_model_dir), "max_tokens": 3, "max_model_len": 64,
                               "max_num_seqs": 2, "shard_size": 2, "engine": "native"}}
    script = f"""
import json, sys, time
from prefect.deployments import run_deployment
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactCollectionFilter
import anyio

async def deployment_ready():
    async with get_client() as c:
        for _ in range(120):
            try:
                d = await c.read_deployment_by_name("batchgen-pipeline/on-demand")
                nightly = await c.read_deployment_by_name("batchgen-pipeline/nightly")
                return d, nightly
            except Exception:
                time.sleep(1)
    raise SystemExit("deployments never appeared")

d, nightly = anyio.run(deployment_ready)
run = run_deployment("batchgen-pipeline/on-demand", parameters=json.loads({json.dumps(parameters)!r}),
                     timeout=400, poll_interval=2)
async def artifacts():
    async with get_client() as c:
        return await c.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(key={{"any_": ["batchgen-headline"]}}))
arts = anyio.run(artifacts)
print(json.dumps({{"state": run.state.type.value, "schedules": [s.schedule.cron for s in nightly.schedules],
                  "artifact": arts[0].data if arts else None}}))
"""
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=540)
    finally:
        served.terminate()
        served.wait(30)
        serve_log.close()
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "serve.log").read_text()[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state"] == "COMPLETED", (tmp_path / "serve.log").read_text()[-3000:]
    assert result["schedules"] == ["0 2 * * *"]
    run_dir = tmp_path / "runs" / "ui-run"
    assert (run_dir / "_SUCCESS").is_file() and (run_dir / "report" / "report.html").is_file()
    ids = read_run_table(run_dir, "requests").column("id").to_pylist()
    assert sorted(ids) == [f"e{i}" for i in range(5)]
    headline = result["artifact"]
    assert headline and "ui-run" in str(headline) and "output_tok_per_s" in str(headline)
