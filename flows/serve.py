"""Serve the batchgen deployments from this process, with no work pool (a laptop, a single box).

    .venv/bin/python -m flows.serve        # then open the Prefect UI and run "on-demand" with the form

On a fleet of GPU machines use prefect.yaml instead (`prefect deploy --all` + workers on a pool).
"""

from __future__ import annotations

from prefect import serve

from flows.pipeline import pipeline
from flows.report import report
from flows.sweep import sweep

DEMO_SETTINGS = {"input": ["configs/demo/prompts.parquet"], "output": "runs", "max_tokens": 96,
                 "max_num_seqs": 16, "max_model_len": 1024, "shard_size": 12}


def deployments():
    return [
        pipeline.to_deployment(name="nightly", cron="0 2 * * *", parameters={"settings": DEMO_SETTINGS},
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
