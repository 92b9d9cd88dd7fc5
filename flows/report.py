"""Prefect flow: DuckDB reports on a run, published as artifacts under stable keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from batchgen.data.fs import basename
from batchgen.report.build import build_report, default_report_dir, format_table

HEADLINE_KEY = "batchgen-headline"
LATENCY_KEY = "batchgen-latency"
REPORT_LINK_KEY = "batchgen-report-html"


def headline_rows(results) -> list[dict[str, Any]]:
    """One row per run: throughput, ITL/TTFT/TPOT percentiles and the conditions that make them comparable."""
    tp = {r["run_id"]: r for r in results["throughput"].to_pylist()}
    cond = {r["run_id"]: r for r in results["run_conditions"].to_pylist()}
    cmp = {r["run_id"]: r for r in results["run_comparison"].to_pylist()}
    rows = []
    for run_id, t in tp.items():
        c, x = cond.get(run_id, {}), cmp.get(run_id, {})
        rows.append({
            "run_id": run_id, "requests": t["num_requests"], "errors": t["num_errors"],
            "output_tok_per_s": round(t["output_tok_per_s"] or 0, 2), "requests_per_s": round(t["requests_per_s"] or 0, 3),
            "itl_p50_ms": _ms(x.get("itl_p50_s")), "itl_p99_ms": _ms(x.get("itl_p99_s")),
            "ttft_p50_s": _r(x.get("ttft_p50_s")), "ttft_p99_s": _r(x.get("ttft_p99_s")),
            "tpot_p50_ms": _ms(x.get("tpot_p50_s")),
            "engine": c.get("engine"), "model": c.get("model"), "dtype": c.get("dtype"),
            "max_num_seqs": c.get("max_num_seqs"), "device": c.get("device_name"),
        })
    return rows


def _ms(v):
    return None if v is None else round(v * 1e3, 2)


def _r(v):
    return None if v is None else round(v, 4)


@flow(name="batchgen-report")
def report(run_dirs: list[str], out_dir: str | None = None, window_s: float | None = None,
           price_per_hour: float | None = None) -> dict[str, Any]:
    """Run the DuckDB reports over one or more run directories and publish headline artifacts.

    Args:
        run_dirs: run directories or globs, local or s3://...; the first is the baseline the others are compared to
        out_dir: where the report's files go (default RUN_DIR/report for a local run)
        window_s: the window of the tok/s-over-time chart, in seconds (default 1)
        price_per_hour: what the machine costs per hour (any currency): adds the cost per million output tokens
    """
    logger = get_run_logger()
    out = Path(out_dir) if out_dir else default_report_dir(run_dirs[0])
    results = build_report(run_dirs, out, window_s=window_s, price_per_hour=price_per_hour)
    rows = headline_rows(results)
    create_table_artifact(rows, key=HEADLINE_KEY, description="batchgen headline figures with run conditions")
    latency = format_table(results["request_latency"]).replace("\n", "\n    ")
    itl = format_table(results["itl_by_context_concurrency"]).replace("\n", "\n    ")
    md = (f"# batchgen latency: {', '.join(basename(d) for d in run_dirs)}\n\n"
          f"Definitions: METRICS.md (TTFT includes queueing; TPOT per request; ITL pooled over tokens).\n\n"
          f"## Per-request latency (s)\n\n    {latency}\n\n## ITL by context length x concurrency (s)\n\n    {itl}\n")
    create_markdown_artifact(md, key=LATENCY_KEY, description="percentile tables")
    html_path = (out / "report.html").resolve()
    create_link_artifact(html_path.as_uri(), link_text="HTML report", key=REPORT_LINK_KEY,
                         description=str(html_path))
    logger.info("report written to %s", out)
    return {"out_dir": str(out), "headline": rows}
