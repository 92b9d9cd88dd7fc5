"""Prefect flow: the throughput-against-latency curve over max_num_seqs, on a sample of a dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import Field

from batchgen.data.fs import Store, is_uri, join
from batchgen.data.reader import PromptDataset
from batchgen.runner import generate as run_generate
from batchgen.report.build import build_report
from batchgen.settings import GenerateSettings
from flows.report import headline_rows

SWEEP_KEY = "batchgen-sweep"


@flow(name="batchgen-sweep")
def sweep(settings: GenerateSettings, max_num_seqs: Annotated[list[int], Field(min_length=1)] = [1, 4, 16],  # noqa: B006
          sample_rows: Annotated[int, Field(ge=1)] = 64, price_per_hour: float | None = None) -> dict[str, Any]:
    """Run one sample at several batch widths and report throughput against latency, to pick max_num_seqs.

    Args:
        settings: the job to sweep; its max_num_seqs is replaced by each width in turn
        max_num_seqs: the batch widths to run, one run each
        sample_rows: the first rows of the input, the same sample for every width
        price_per_hour: what the machine costs per hour (any currency): adds each width's cost per million
            output tokens
    """
    logger = get_run_logger()
    base = settings.run_id or "sweep"
    root = join(settings.output, base)  # a local directory or an object-store prefix
    store = Store(root)
    store.makedirs()
    if not store.exists("sample.parquet"):
        shard = PromptDataset(settings.input).read_shard(0, sample_rows)  # the first rows, deterministic
        buf = pa.BufferOutputStream()
        pq.write_table(shard.table, buf)
        store.write("sample.parquet", buf.getvalue().to_pybytes())
    run_dirs = []
    for width in sorted(set(max_num_seqs)):
        s = settings.model_copy(update={"input": [store.path("sample.parquet")], "output": root,
                                        "run_id": f"{base}-mns{width}",
                                        "max_num_seqs": width, "progress": False})
        summary = run_generate(s.to_run_config())
        logger.info("max_num_seqs=%s: %s", width, summary)
        run_dirs.append(summary.run_dir)
    report_dir = Path(f"report-{base}") if is_uri(root) else Path(root) / "report"  # the report is local files
    results = build_report(run_dirs, report_dir, price_per_hour=price_per_hour)
    frontier = {r["run_id"]: r["on_frontier"] for r in results["latency_frontier"].to_pylist()}
    cost = {r["run_id"]: r["cost_per_million_output_tokens"] for r in results["cost"].to_pylist()}
    rows = sorted(({**r, "on_frontier": frontier.get(r["run_id"]), "cost_per_million_output_tokens": cost.get(r["run_id"])}
                   for r in headline_rows(results)), key=lambda r: r["max_num_seqs"] or 0)
    create_table_artifact(rows, key=SWEEP_KEY, description="throughput against latency by max_num_seqs")
    return {"report": str(report_dir), "curve": rows}
