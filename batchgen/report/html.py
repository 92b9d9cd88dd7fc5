"""The self-contained HTML report: tables and inline-SVG charts, each captioned with its run conditions."""

from __future__ import annotations

import html
import time
from collections import defaultdict

import pyarrow as pa

from batchgen.report.svg import box_chart, line_chart

METRIC_NOTE = ("Definitions: docs/METRICS.md in batchgen. TTFT includes queueing. TPOT = (last − first token time) / "
               "(n_out − 1), vLLM bench's TPOT (genai-perf's ITL). ITL = gaps between a request's consecutive "
               "tokens, pooled over tokens (vLLM bench's ITL). Percentiles are exact (DuckDB quantile_cont).")
CONDITION_KEYS = ("engine", "model", "dtype", "quantization", "max_num_seqs", "max_model_len", "kv_budget_tokens",
                  "temperature", "max_tokens", "speculative", "device_name", "cpu_cores", "peak_read_bytes_per_s")
MAX_POINTS = 1500


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.4e}"
    return html.escape(str(v))


def table_html(t: pa.Table, max_rows: int = 200) -> str:
    rows = t.slice(0, max_rows).to_pylist()
    head = "".join(f"<th>{html.escape(c)}</th>" for c in t.column_names)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r[c])}</td>" for c in t.column_names) + "</tr>" for r in rows)
    more = f"<p class=note>{t.num_rows - max_rows} more rows in the Parquet/CSV file.</p>" if t.num_rows > max_rows else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def partial_notes(results: dict[str, pa.Table]) -> list[str]:
    """One line per unfinished run: reports read committed shards only, and say so."""
    return [f"run {r['run_id']} is partial — unfinished: {r['shards_committed']} of {r['shards']} shards, "
            f"{r['rows_committed']} of {r['rows']} rows committed; every figure covers those rows only"
            for r in results["run_status"].to_pylist() if r["partial"]]


def conditions_caption(conditions: pa.Table) -> str:
    lines = []
    for r in conditions.to_pylist():
        parts = [f"{k}={_cell(r.get(k))}" for k in CONDITION_KEYS if k in r]
        lines.append(f"<b>{html.escape(r['run_id'])}</b>: " + ", ".join(parts))
    return "<p class=cond>Run conditions — " + "<br>".join(lines) + "</p>"


def _by_run(t: pa.Table, x: str, y: str) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list] = defaultdict(list)
    for r in t.select(["run_id", x, y]).to_pylist():
        series[r["run_id"]].append((float(r[x]), None if r[y] is None else float(r[y])))
    for k, pts in series.items():  # keep the SVG small on long runs
        if len(pts) > MAX_POINTS:
            stride = len(pts) / MAX_POINTS
            series[k] = [pts[int(i * stride)] for i in range(MAX_POINTS)]
    return dict(series)


def render(results: dict[str, pa.Table], run_dirs: list[str]) -> str:
    cond = conditions_caption(results["run_conditions"])
    itl = defaultdict(list)
    for r in results["itl_by_concurrency"].to_pylist():
        label = str(r["concurrency_lo"]) if r["concurrency_lo"] == r["concurrency_hi"] else \
            f"{r['concurrency_lo']}–{r['concurrency_hi']}"
        itl[r["run_id"]].append((label, r["p5_s"] * 1e3, r["p25_s"] * 1e3, r["p50_s"] * 1e3, r["p75_s"] * 1e3,
                                 r["p95_s"] * 1e3))
    charts = [
        ("ITL by concurrency", box_chart(dict(itl), "Inter-token latency by concurrency (box p25–p75, whiskers "
                                                    "p5–p95)", "concurrent sequences", "ITL (ms)")),
        ("TTFT CDF", line_chart(_by_run(results["ttft_cdf"], "ttft_s", "fraction"), "TTFT CDF", "TTFT (s)",
                                "fraction of requests")),
        ("Throughput over time", line_chart(_by_run(results["throughput_over_time"], "window_start_t",
                                                    "output_tok_per_s"), "Output tok/s over time",
                                            "time since run start (s)", "output tok/s")),
        ("Throughput against batch size", line_chart(_by_run(results["step_time_by_batch"], "num_running",
                                                             "output_tok_per_s"),
                                                     "Decode throughput against batch size",
                                                     "running sequences", "output tok/s", markers=True)),
        ("MBU over steps", line_chart(_by_run(results["mbu_over_steps"], "start_t", "mbu"),
                                      "Memory-bandwidth utilisation per step", "time since run start (s)", "MBU")),
    ]
    tables = [("Throughput", "throughput"), ("Request latency (s)", "request_latency"),
              ("ITL by context length × concurrency (s)", "itl_by_context_concurrency"),
              ("ITL per step (s; differs from token ITL with speculative decoding)", "itl_per_step"),
              ("Decode step time by batch size", "step_time_by_batch"),
              ("KV cache: preemptions and prefix-cache hits", "kv_cache"), ("Runs compared", "run_comparison"),
              ("Run conditions", "run_conditions")]
    banner = "".join(f"<p class=partial>{html.escape(n)}</p>" for n in partial_notes(results))
    body = [f"<h1>batchgen report</h1>{banner}<p class=note>{html.escape(', '.join(run_dirs))} — generated "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}</p><p class=note>{html.escape(METRIC_NOTE)}</p>"]
    for title, svg in charts:
        body.append(f"<section><h2>{html.escape(title)}</h2>{svg}{cond}</section>")
    for title, name in tables:
        body.append(f"<section><h2>{html.escape(title)}</h2>{table_html(results[name])}{cond}</section>")
    style = ("body{font-family:sans-serif;margin:24px;max-width:1100px} table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right} th{background:#f4f4f4}"
             ".partial{background:#fff3cd;border:1px solid #e0b000;padding:8px;font-weight:bold}"
             ".cond{font-size:11px;color:#555} .note{font-size:12px;color:#555} section{margin-bottom:28px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>batchgen report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")
