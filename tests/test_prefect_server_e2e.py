"""End to end, as the README's quickstart has a person do it: `make ui` (python -m flows.ui) starts a
real `prefect server` on loopback, waits for it and serves the deployments from the repository root;
a run is started through the API with parameters the way the UI's form posts them, its outputs and
artifacts are checked, and SIGTERM (Ctrl-C) stops the server and the serving process both."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, free_port, read_run_table, write_prompts

pytestmark = pytest.mark.heavy  # starts vLLM, a Prefect server or a Ray cluster: not in `make test-fast`


def test_ui_style_run_of_the_on_demand_deployment(tmp_path, tiny_model_dir):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
    serve_log = open(tmp_path / "serve.log", "w")
    served = subprocess.Popen([sys.executable, "-m", "flows.ui", "--port", str(port)], env=env, cwd=REPO,
                              stdout=serve_log, stderr=subprocess.STDOUT)
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
        served.send_signal(signal.SIGTERM)  # what Ctrl-C does: both processes end
        stopped = served.wait(60)
        serve_log.close()
    log = (tmp_path / "serve.log").read_text()
    assert stopped == 0 and f"Prefect UI at http://127.0.0.1:{port}" in log, log[-3000:]
    with pytest.raises(OSError):  # the server is gone with it
        import urllib.request

        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
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
