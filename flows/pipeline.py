"""Prefect flow: generate then report, as one deployable pipeline."""

from __future__ import annotations

from typing import Any

from prefect import flow

from batchgen.settings import GenerateSettings
from flows.generate import FanOut, generate
from flows.report import report


@flow(name="batchgen-pipeline")
def pipeline(settings: GenerateSettings, fanout: FanOut = FanOut()) -> dict[str, Any]:
    """Generate a dataset, then publish its latency and throughput report."""
    run = generate(settings, fanout)
    rep = report([run["run_dir"]])
    return {**run, "report": rep["out_dir"]}
