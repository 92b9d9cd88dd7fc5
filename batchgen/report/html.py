"""The self-contained HTML report: Plotly charts (charts.py) and tables, each captioned with its run conditions.

One file with everything inlined (Plotly's JS included), so it opens offline and can be mailed or
kept beside the run."""

from __future__ import annotations

import html
import time
from collections import defaultdict
from typing import Any

import pyarrow as pa

from batchgen.report.charts import DATASET_CHARTS, Chart, build_charts

METRIC_NOTE = ("Definitions: docs/METRICS.md in batchgen. TTFT includes queueing. TPOT = (last − first token time) / "
               "(n_out − 1), vLLM bench's TPOT (genai-perf's ITL). ITL = gaps between a request's consecutive "
               "tokens, pooled over tokens (vLLM bench's ITL). Percentiles are exact (DuckDB quantile_cont).")
CONDITION_KEYS = ("engine", "model", "dtype", "quantization", "max_num_seqs", "max_model_len", "kv_budget_tokens",
                  "temperature", "max_tokens", "speculative", "device_name", "cpu_cores", "peak_read_bytes_per_s")


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


def conditions_diff_html(t: pa.Table) -> str:
    """Conditions x runs, the rows where the runs differ highlighted: what makes two figures incomparable."""
    rows = t.to_pylist()
    runs = sorted({r["run_id"] for r in rows})
    cells: dict[str, dict[str, Any]] = defaultdict(dict)
    differs = {}
    for r in rows:
        cells[r["condition"]][r["run_id"]] = r["value"]
        differs[r["condition"]] = r["differs"]
    head = "<tr><th>condition</th>" + "".join(f"<th>{html.escape(run)}</th>" for run in runs) + "</tr>"
    order = sorted(cells, key=lambda c: (not differs[c], c))  # what differs first
    body = "".join(f"<tr class={'differs' if differs[c] else 'same'}><td>{html.escape(c)}</td>"
                   + "".join(f"<td>{_cell(cells[c].get(run))}</td>" for run in runs) + "</tr>" for c in order)
    n = sum(differs.values())
    note = (f"<p class=note>{n} condition(s) differ between the runs (highlighted).</p>" if len(runs) > 1 else "")
    return f"{note}<table class=conditions>{head}{body}</table>"


def _figure_json(figure: dict[str, Any]) -> str:
    # go.Figure validates every attribute name against Plotly's schema: a typo fails here, not silently
    import plotly.graph_objects as go
    import plotly.io as pio

    return pio.to_json(go.Figure(figure), validate=True).replace("</", "<\\/")


def chart_html(chart: Chart, cond: str) -> str:
    return (f"<section><h2>{html.escape(chart.title)}</h2><p class=note>{html.escape(chart.caption)}</p>"
            f"<div class=chart id='{chart.key}' data-queries='{' '.join(chart.queries)}'></div>"
            f"<script type='application/json' id='{chart.key}-spec'>{_figure_json(chart.figure)}</script>"
            f"{cond}</section>")


# draws every chart from its JSON spec; Plotly is inlined once in the page's head
DRAW = """
for (const el of document.querySelectorAll('div.chart')) {
  const spec = JSON.parse(document.getElementById(el.id + '-spec').textContent);
  Plotly.newPlot(el, spec.data, spec.layout, {responsive: true, displaylogo: false});
}
"""


DATASET_TABLES = (("Finish reasons", "finish_reasons"), ("Error reasons (numbers shown as N)", "error_reasons"),
                  ("Outputs that repeat, word for word", "duplicate_outputs"))
# the sample's search box and sortable columns: rows are compared by their cells' textContent, and no
# cell is ever written back as HTML, so a row's text stays text
SAMPLE_JS = """
(function () {
  const table = document.getElementById('sample-rows'), box = document.getElementById('sample-search');
  const body = table.tBodies[0], count = document.getElementById('sample-count');
  function shown() { count.textContent = [...body.rows].filter(r => r.style.display !== 'none').length; }
  box.addEventListener('input', () => {
    const q = box.value.toLowerCase();
    for (const row of body.rows) row.style.display = row.textContent.toLowerCase().includes(q) ? '' : 'none';
    shown();
  });
  for (const th of table.tHead.rows[0].cells) {
    th.addEventListener('click', () => {
      const i = th.cellIndex, numeric = th.dataset.numeric === '1', dir = th.dataset.dir === 'asc' ? -1 : 1;
      for (const other of table.tHead.rows[0].cells) delete other.dataset.dir;
      th.dataset.dir = dir === 1 ? 'asc' : 'desc';
      const key = (row) => row.cells[i].textContent;
      const rows = [...body.rows].sort((a, b) => dir * (numeric ? (parseFloat(key(a)) || 0) - (parseFloat(key(b)) || 0)
                                                              : key(a).localeCompare(key(b))));
      for (const row of rows) body.appendChild(row);
    });
  }
  shown();
})();
"""


def sample_table_html(t: pa.Table) -> str:
    """The sample of rows as a searchable table whose headers sort it (SAMPLE_JS); every cell escaped."""
    numeric = {f.name for f in t.schema if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)}
    head = "".join(f"<th data-numeric={int(c in numeric)} title='sort'>{html.escape(c)}</th>" for c in t.column_names)
    body = "".join("<tr>" + "".join(f"<td class=text>{_cell(r[c])}</td>" for c in t.column_names) + "</tr>"
                   for r in t.to_pylist())
    return (f"<p><input id=sample-search type=search placeholder='search prompts and outputs' size=40> "
            f"<span class=note><span id=sample-count>{t.num_rows}</span> of {t.num_rows} rows shown; click a "
            f"column to sort</span></p><table id=sample-rows class=sample><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table><script>{SAMPLE_JS}</script>")


def dataset_html(results: dict[str, pa.Table], charts: list[Chart], cond: str) -> str:
    """The page of what was generated: outcomes, finish reasons, output lengths, errors, repeats, and
    a sample of the rows themselves."""
    parts = ["<section id=dataset><h2>Dataset: what was generated</h2><p class=note>Generated and reused rows "
             "alike (reused rows are this run's dataset too). length_share: rows that ran into max_tokens (or the "
             "context); finished_repetition: rows stopped in a loop; duplicate_share: rows whose output another row "
             "of the run has word for word; with_reasoning: rows with a thought apart from their answer (its "
             "tokens against the answer's; cut by its budget; never closed before max_tokens).</p>",
             table_html(results["dataset_summary"])]
    parts += [chart_html(c, cond) for c in charts]
    parts += [f"<h3>{html.escape(title)}</h3>{table_html(results[name])}" for title, name in DATASET_TABLES]
    sample = results["sample_rows"]
    kept = sample.num_rows and any(v is not None for v in sample.column("prompt").to_pylist())
    parts.append("<h3>A sample of the rows</h3><p class=note>Up to 500 rows per run, the same ones each time"
                 + ("" if kept else "; this run was made before requests/ held each row's prompt") + ".</p>"
                 + sample_table_html(sample))
    return "".join(parts) + "</section>"


def render(results: dict[str, pa.Table], run_dirs: list[str]) -> str:
    from plotly.offline import get_plotlyjs

    cond = conditions_caption(results["run_conditions"])
    charts = {c.key: c for c in build_charts(results)}
    tables = [("Throughput", "throughput"), ("ITL pooled over all tokens (s)", "itl_overall"),
              ("Request latency (s)", "request_latency"),
              ("ITL by context length × concurrency (s)", "itl_by_context_concurrency"),
              ("ITL per step (s; differs from token ITL with speculative decoding)", "itl_per_step"),
              ("Decode step time by batch size", "step_time_by_batch"),
              ("KV cache: preemptions and prefix-cache hits", "kv_cache"),
              ("Cost (set with --price-per-hour)", "cost"), ("Runs compared", "run_comparison"),
              ("Figures against the baseline run", "run_delta"), ("Throughput against latency", "latency_frontier")]
    banner = "".join(f"<p class=partial>{html.escape(n)}</p>" for n in partial_notes(results))
    body = [f"<h1>batchgen report</h1>{banner}<p class=note>{html.escape(', '.join(run_dirs))} — generated "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}</p><p class=note>{html.escape(METRIC_NOTE)}</p>"]
    body.append("<section><h2>Rows: generated, reused from earlier runs, errors</h2><p class=note>Rows reused "
                "(--reuse-from) are copied from the run named in reused_from_run, and no latency or throughput "
                f"figure counts them.</p>{table_html(results['run_status'])}</section>")
    body.append(f"<section><h2>Headline</h2>{table_html(results['throughput'])}"
                f"{table_html(results['itl_overall'])}{table_html(results['cost'])}</section>")
    body += [chart_html(c, cond) for key, c in charts.items() if key not in DATASET_CHARTS]
    body.append(dataset_html(results, [charts[k] for k in DATASET_CHARTS], cond))
    body.append(f"<section><h2>Run conditions</h2>{conditions_diff_html(results['run_conditions_diff'])}</section>")
    for title, name in tables:
        body.append(f"<section><h2>{html.escape(title)}</h2>{table_html(results[name])}{cond}</section>")
    style = ("body{font-family:sans-serif;margin:24px;max-width:1200px} table{border-collapse:collapse;font-size:12px;"
             "margin:6px 0} td,th{border:1px solid #ccc;padding:3px 6px;text-align:right} th{background:#f4f4f4}"
             ".partial{background:#fff3cd;border:1px solid #e0b000;padding:8px;font-weight:bold}"
             "tr.differs td{background:#fff3cd;font-weight:bold} .conditions td:first-child{text-align:left}"
             ".cond{font-size:11px;color:#555} .note{font-size:12px;color:#555} section{margin-bottom:28px}"
             ".sample td.text{text-align:left;white-space:pre-wrap;max-width:420px;vertical-align:top}"
             ".sample th{cursor:pointer}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>batchgen report</title>"
            f"<style>{style}</style><script>{get_plotlyjs()}</script></head><body>{''.join(body)}"
            f"<script>{DRAW}</script></body></html>")
