"""`batchgen report`: run every query, save each result as Parquet and CSV, render the HTML report."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.report.html import partial_notes, render
from batchgen.report.queries import LARGE, QUERIES, connect, copy_query


def default_report_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/report for a local run; ./report-<run id> here for a run on an object store."""
    from batchgen.data.fs import basename, is_uri

    return Path(f"report-{basename(run_dir)}") if is_uri(run_dir) else Path(run_dir) / "report"


def build_report(run_dirs: list[str | Path], out_dir: str | Path, window_s: float | None = None,
                 memory_limit: str | None = None, price_per_hour: float | None = None) -> dict[str, pa.Table]:
    con = connect(run_dirs, window_s=window_s, memory_limit=memory_limit, price_per_hour=price_per_hour)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in QUERIES:
        copy_query(con, name, out / f"{name}.parquet", out / f"{name}.csv")
        if name not in LARGE:
            results[name] = pq.read_table(out / f"{name}.parquet")
    (out / "report.html").write_text(render(results, [str(d) for d in run_dirs]))
    return results


def format_table(t: pa.Table, columns: list[str] | None = None, max_rows: int = 30) -> str:
    """A plain-text table for the terminal."""
    cols = columns or t.column_names
    rows = t.select(cols).slice(0, max_rows).to_pylist()

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


HEADLINES = (
    ("Throughput", "throughput", ["run_id", "num_requests", "num_errors", "output_tokens", "window_s",
                                  "output_tok_per_s", "total_tok_per_s", "requests_per_s"]),
    ("Request latency (s)", "request_latency", ["run_id", "metric", "n", "mean_s", "p50_s", "p90_s", "p95_s",
                                                "p99_s", "max_s"]),
    ("ITL pooled over all tokens (s)", "itl_overall", ["run_id", "n", "mean_s", "p50_s", "p90_s", "p95_s", "p99_s",
                                                       "max_s"]),
    ("ITL by concurrency (s, pooled over tokens)", "itl_by_concurrency",
     ["run_id", "concurrency_lo", "concurrency_hi", "n", "mean_s", "p50_s", "p95_s", "p99_s"]),
    ("KV cache", "kv_cache", ["run_id", "num_preemptions", "requests_preempted", "prefix_hit_rate",
                              "prefill_tokens_computed", "peak_running", "peak_kv_usage"]),
    ("What the runs took", "cost", ["run_id", "attempts", "machine_s", "window_s", "output_tokens", "price_per_hour",
                                    "cost", "cost_per_million_output_tokens"]),
    ("Run conditions", "run_conditions", ["run_id", "engine", "model", "dtype", "max_num_seqs", "max_model_len",
                                          "temperature", "device_name", "cpu_cores", "peak_read_bytes_per_s"]),
)


HEADLINE_QUERIES = ("run_status", *(name for _, name, _ in HEADLINES))  # what headline_text reads


def headline_text(results: dict[str, pa.Table]) -> str:
    tables = "\n\n".join(f"{title}\n{format_table(results[name], cols)}" for title, name, cols in HEADLINES)
    notes = partial_notes(results)
    return "\n".join(notes) + "\n\n" + tables if notes else tables
