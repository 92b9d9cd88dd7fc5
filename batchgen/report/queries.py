"""Loads sql/*.sql by name and runs them over one or many run directories with DuckDB.

Each query is also registered as a view named after its file, so a later query can read an
earlier one (run_comparison reads throughput and run_conditions).
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa

def _sql_dir() -> Path:
    """sql/ of a checkout, else the copy installed inside the package (batchgen.sql)."""
    here = Path(__file__).resolve().parents[2] / "sql"
    if here.is_dir():
        return here
    from importlib.resources import files

    return Path(str(files("batchgen.sql")))


SQL_DIR = _sql_dir()
# in dependency order
QUERIES = ("run_status", "run_conditions", "throughput", "request_latency", "itl_overall",
           "itl_by_context_concurrency", "itl_by_concurrency", "itl_per_step", "kv_cache", "throughput_over_time",
           "step_timeline", "step_windows", "step_time_by_batch", "ttft_cdf", "run_comparison",
           "run_conditions_diff", "run_delta", "latency_frontier", "cost",
           "dataset_summary", "finish_reasons", "output_lengths", "error_reasons", "duplicate_outputs", "sample_rows")
LARGE = {"step_timeline"}  # one row per step: written by DuckDB straight to files, never loaded whole


class ReportError(RuntimeError):
    pass


def load_sql(name: str) -> str:
    path = SQL_DIR / f"{name}.sql"
    if not path.is_file():
        raise ReportError(f"no query named {name!r} in {SQL_DIR}")
    return path.read_text()


def _literal(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def connect(run_dirs: list[str | Path], window_s: float | None = None, memory_limit: str | None = None,
            price_per_hour: float | None = None) -> duckdb.DuckDBPyConnection:
    """A connection with the run views (requests, errors, tokens, steps, runs) and every query view."""
    from batchgen.data.fs import Store, filesystem, is_uri

    dirs = [str(d).rstrip("/") for d in run_dirs]
    for d in dirs:
        if any(ch in d for ch in "*?["):
            continue
        store = Store(d)
        if not store.exists("run.json"):
            raise ReportError(f"{d} is not a run directory (no run.json)")
        if not any(f.rsplit("/", 1)[-1].startswith("shard=") for f in store.list("_manifests")):
            raise ReportError(f"{d}: no shard is committed yet, so there is nothing to report")
    con = duckdb.connect()
    # runs on an object store are read through fsspec, registered with DuckDB (no extension to download)
    for proto in sorted({d.split("://", 1)[0] for d in dirs if is_uri(d)}):
        con.register_filesystem(filesystem(f"{proto}://{next(d for d in dirs if d.startswith(proto))}")[0])
    if memory_limit:
        con.execute(f"set memory_limit = {_literal(memory_limit)}")
    con.execute(f"set variable runs = [{', '.join(_literal(d) for d in dirs)}]")
    if window_s is not None:
        con.execute(f"set variable window_s = {float(window_s)!r}")
    if price_per_hour is not None:
        if not price_per_hour >= 0:
            raise ReportError(f"--price-per-hour must be a non-negative number, got {price_per_hour!r}")
        con.execute(f"set variable price_per_hour = {float(price_per_hour)!r}")
    for statement in duckdb.extract_statements(load_sql("views")):  # in order: a view may need a variable set before
        con.execute(statement)
    for name in QUERIES:
        con.execute(f"create or replace view {name} as {load_sql(name)}")
    return con


def copy_query(con: duckdb.DuckDBPyConnection, name: str, parquet_path: Path, csv_path: Path) -> None:
    """Stream a query's result to Parquet and CSV inside DuckDB (no Python-side materialisation)."""
    con.execute(f"copy (select * from {name}) to {_literal(str(parquet_path))} (format parquet)")
    con.execute(f"copy (select * from {name}) to {_literal(str(csv_path))} (format csv, header)")


def run_query(con: duckdb.DuckDBPyConnection, name: str) -> pa.Table:
    if name not in QUERIES:
        raise ReportError(f"unknown query {name!r}; known: {', '.join(QUERIES)}")
    return con.sql(f"select * from {name}").to_arrow_table()
