"""Serve the batchgen deployments from this process, with no work pool (a laptop, a single box).

    .venv/bin/python -m flows.serve        # then open the Prefect UI and run "on-demand" with the form

On a fleet of GPU machines use prefect.yaml instead (`prefect deploy --all` + workers on a pool).
"""

from __future__ import annotations

from pathlib import Path

from prefect import serve

from batchgen.settings import load_yaml
from flows.pipeline import pipeline
from flows.report import report
from flows.sweep import sweep

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml"  # the embedded default's settings


def deployments():
    return [
        pipeline.to_deployment(name="nightly", cron="0 2 * * *", parameters={"settings": load_yaml(DEMO_CONFIG)},
                               description="Nightly generation of the demo dataset, then its report.",
                               tags=["batchgen", "scheduled"]),
        pipeline.to_deployment(name="on-demand", description="Generate a dataset, then report: fill in the form.",
                               tags=["batchgen"]),
        report.to_deployment(name="report", description="Reports over one or more run directories.",
                             tags=["batchgen"]),
        sweep.to_deployment(name="sweep", description="Throughput against latency over max_num_seqs.",
                            tags=["batchgen"]),
    ]


def main() -> None:
    serve(*deployments())


if __name__ == "__main__":
    main()
