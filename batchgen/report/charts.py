"""The report's charts as Plotly figures, one function per question, each drawn from one query's result.

Plotly because its whole JS library ships inside the `plotly` wheel (inlined once per page, so the
report opens offline, from an e-mail or a bucket), and it gives log axes, hover with exact values,
zoom and pan, and precomputed box plots without any code of ours in the browser.

Every point a chart draws is one row of its query (rows with a null in the plotted column are left
out): nothing is thinned here. Where a series is long, the query aggregates it (step_windows keeps
min/max per window). Each trace carries `meta = {"query", "column"[, "filter"]}` saying which rows it
draws, so a test can count a chart's points in the browser against the query's Parquet file.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
DASH = {"p50_s": "solid", "p95_s": "dash", "p99_s": "dot"}


@dataclass
class Chart:
    key: str          # the div's id
    title: str
    caption: str      # how to read it
    figure: dict[str, Any]

    @property
    def queries(self) -> list[str]:
        return sorted({t["meta"]["query"] for t in self.figure["data"]})


def _rows(t: pa.Table) -> list[dict[str, Any]]:
    return t.to_pylist()


def _colors(results: dict[str, pa.Table]) -> dict[str, str]:
    runs = sorted({r["run_id"] for r in _rows(results["run_conditions"])})
    return {run: PALETTE[i % len(PALETTE)] for i, run in enumerate(runs)}


def _meta(query: str, column: str, where: str | None = None) -> dict[str, str]:
    return {"query": query, "column": column, **({"filter": where} if where else {})}


def _layout(x_title: str, y_title: str, *, x_log: bool = False, y_log: bool = False, **extra) -> dict[str, Any]:
    return {"xaxis": {"title": {"text": x_title}, "type": "log" if x_log else "linear"},
            "yaxis": {"title": {"text": y_title}, "type": "log" if y_log else "linear"},
            "hovermode": "closest", "margin": {"t": 30, "r": 20}, "height": 420,
            "legend": {"orientation": "h", "y": -0.2}, **extra}


def _ms(v):
    return None if v is None else v * 1e3


def itl_vs_context(results, colors) -> Chart:
    """ITL against context length: one line per run x concurrency bucket x percentile."""
    rows = _rows(results["itl_by_context_concurrency"])
    cats = [f"{c}–{h}" for c, h in sorted({(r["context_lo"], r["context_hi"]) for r in rows})]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["run_id"], r["concurrency_lo"], r["concurrency_hi"])].append(r)
    runs = sorted({k[0] for k in groups})
    data = []
    for (run, lo, hi), pts in sorted(groups.items()):
        conc = str(lo) if lo == hi else f"{lo}–{hi}"
        name = f"{run} · {conc} seqs" if len(runs) > 1 else f"{conc} concurrent seqs"
        # colour = concurrency bucket, dash = percentile, marker = run
        color = PALETTE[(lo.bit_length() - 1) % len(PALETTE)]
        symbol = ("circle", "square", "diamond", "triangle-up", "cross", "x")[runs.index(run) % 6]
        for col, dash in DASH.items():
            kept = [p for p in pts if p[col] is not None]
            data.append({
                "type": "scatter", "mode": "lines+markers", "name": f"{name} {col[:3]}", "legendgroup": name,
                "x": [f"{p['context_lo']}–{p['context_hi']}" for p in kept], "y": [_ms(p[col]) for p in kept],
                "customdata": [p["n"] for p in kept], "line": {"dash": dash, "color": color},
                "marker": {"symbol": symbol, "color": color},
                "hovertemplate": f"{name}<br>context %{{x}}<br>{col[:3]} %{{y:.3f}} ms<br>n=%{{customdata}}"
                                 "<extra></extra>",
                "meta": _meta("itl_by_context_concurrency", col)})
    layout = _layout("context length (tokens)", "ITL (ms)", y_log=True)
    layout["xaxis"].update(type="category", categoryorder="array", categoryarray=cats)
    return Chart("itl-context", "ITL against context length, per concurrency bucket",
                 "Colour: concurrency bucket; solid p50, dashed p95, dotted p99. Log scale: the tail is the point.", {"data": data,
                                                                                            "layout": layout})


def itl_by_concurrency(results, colors) -> Chart:
    """Box per concurrency bucket from the query's exact percentiles (p5/p25/p50/p75/p95)."""
    by_run = defaultdict(list)
    for r in _rows(results["itl_by_concurrency"]):
        by_run[r["run_id"]].append(r)
    data = []
    for run, rows in sorted(by_run.items()):
        data.append({
            "type": "box", "name": run, "marker": {"color": colors.get(run)},
            "x": [str(r["concurrency_lo"]) if r["concurrency_lo"] == r["concurrency_hi"] else
                  f"{r['concurrency_lo']}–{r['concurrency_hi']}" for r in rows],
            "lowerfence": [_ms(r["p5_s"]) for r in rows], "q1": [_ms(r["p25_s"]) for r in rows],
            "median": [_ms(r["p50_s"]) for r in rows], "q3": [_ms(r["p75_s"]) for r in rows],
            "upperfence": [_ms(r["p95_s"]) for r in rows], "mean": [_ms(r["mean_s"]) for r in rows],
            "meta": _meta("itl_by_concurrency", "p50_s")})
    layout = _layout("concurrent sequences", "ITL (ms)", y_log=True, boxmode="group")
    layout["xaxis"]["type"] = "category"
    return Chart("itl-concurrency", "ITL by concurrency",
                 "Box p25–p75 with the median, whiskers p5–p95, dashed line the mean; pooled over tokens.",
                 {"data": data, "layout": layout})


def ttft_cdf(results, colors) -> Chart:
    by_run = defaultdict(list)
    for r in _rows(results["ttft_cdf"]):
        if r["ttft_s"] is not None:
            by_run[r["run_id"]].append(r)
    data = [{"type": "scatter", "mode": "lines", "name": run, "line": {"color": colors.get(run)},
             "x": [r["ttft_s"] for r in rows], "y": [r["fraction"] for r in rows],
             "hovertemplate": f"{run}<br>%{{y:.0%}} of requests within %{{x:.4f}} s<extra></extra>",
             "meta": _meta("ttft_cdf", "ttft_s")} for run, rows in sorted(by_run.items())]
    return Chart("ttft-cdf", "Time to first token (CDF)",
                 "TTFT includes queueing: in an offline batch most of it is waiting for a slot.",
                 {"data": data, "layout": _layout("TTFT (s)", "fraction of requests", x_log=True)})


def step_timeline(results, colors) -> Chart:
    """Batch size, step time, prefill tokens, preemptions and prefix-cache hits on one time axis."""
    rows = _rows(results["step_windows"])
    by_run = defaultdict(list)
    for r in rows:
        by_run[r["run_id"]].append(r)
    panels = (("running seqs", "min_running", "max_running"), ("step time (ms)", "min_step_s", "max_step_s"),
              ("tokens", None, None), ("MBU", "min_mbu", "max_mbu"))
    data = []
    for run, pts in sorted(by_run.items()):
        color = colors.get(run)
        x = [p["start_t"] for p in pts]
        for i, (label, lo, hi) in enumerate(panels, start=1):
            axis = "" if i == 1 else str(i)
            if lo is None:
                for col, name, kind in (("prefill_tokens", "prefill tokens", "bar"),
                                        ("prefix_cached_tokens", "prefix-cache hit tokens", "bar"),
                                        ("preemptions", "preemptions", "markers")):
                    kept = [(xx, p[col]) for xx, p in zip(x, pts) if p[col]]
                    trace = {"x": [k[0] for k in kept], "y": [k[1] for k in kept], "name": f"{run} {name}",
                             "legendgroup": run, "xaxis": "x", "yaxis": f"y{axis}",
                             "meta": _meta("step_windows", col, where="nonzero")}
                    if kind == "bar":
                        trace.update(type="bar", marker={"color": color, "opacity": 0.5 if "prefix" in col else 0.9},
                                     hovertemplate=f"{run} {name}: %{{y}} at %{{x:.3f}} s<extra></extra>")
                    else:
                        trace.update(type="scatter", mode="markers", marker={"symbol": "x", "size": 9, "color": "black"},
                                     hovertemplate=f"{run} preemptions: %{{y}} at %{{x:.3f}} s<extra></extra>")
                    data.append(trace)
                continue
            scale = 1e3 if lo.endswith("_s") else 1
            for col, fill in ((lo, "none"), (hi, "tonexty")):  # the max line fills down to the min line
                kept = [(xx, p[col] * scale) for xx, p in zip(x, pts) if p[col] is not None]
                data.append({"type": "scatter", "mode": "lines", "x": [k[0] for k in kept],
                             "y": [k[1] for k in kept], "fill": fill, "line": {"color": color, "width": 1},
                             "name": f"{run} {label} {col[:3]}", "legendgroup": run, "showlegend": False,
                             "xaxis": "x", "yaxis": f"y{axis}",
                             "hovertemplate": f"{run} {label} {col[:3]} %{{y:.4g}} at %{{x:.3f}} s<extra></extra>",
                             "meta": _meta("step_windows", col)})
    layout = {"height": 720, "hovermode": "closest", "margin": {"t": 30, "r": 20}, "barmode": "overlay",
              "legend": {"orientation": "h", "y": -0.08},
              "xaxis": {"title": {"text": "time since run start (s)"}, "anchor": "y4"}}
    edges = [(0.78, 1.0), (0.53, 0.75), (0.28, 0.50), (0.0, 0.25)]
    for i, ((label, lo, _), dom) in enumerate(zip(panels, edges), start=1):
        key = "yaxis" if i == 1 else f"yaxis{i}"
        layout[key] = {"title": {"text": label}, "domain": list(dom), "anchor": "x",
                       **({"type": "log", "dtick": 1} if lo == "min_step_s" else {"type": "linear"})}
    return Chart("step-timeline", "Step timeline",
                 "Each band spans the min to max of its window (one step per window up to 1000 steps, equal "
                 "step counts per window beyond); tokens and preemptions are sums per window. Drag to zoom.",
                 {"data": data, "layout": layout})


def throughput_over_time(results, colors) -> Chart:
    by_run = defaultdict(list)
    for r in _rows(results["throughput_over_time"]):
        by_run[r["run_id"]].append(r)
    data = [{"type": "scatter", "mode": "lines", "name": run, "line": {"color": colors.get(run), "shape": "hv"},
             "x": [r["window_start_t"] for r in rows], "y": [r["output_tok_per_s"] for r in rows],
             "meta": _meta("throughput_over_time", "output_tok_per_s")} for run, rows in sorted(by_run.items())]
    return Chart("throughput-time", "Output tokens per second over time",
                 "Every token counted in fixed windows (--window-s).",
                 {"data": data, "layout": _layout("time since run start (s)", "output tok/s")})


def throughput_by_batch(results, colors) -> Chart:
    by_run = defaultdict(list)
    for r in _rows(results["step_time_by_batch"]):
        by_run[r["run_id"]].append(r)
    data = [{"type": "scatter", "mode": "lines+markers", "name": run, "line": {"color": colors.get(run)},
             "x": [r["num_running"] for r in rows], "y": [r["output_tok_per_s"] for r in rows],
             "customdata": [[r["n"], _ms(r["p50_step_s"])] for r in rows],
             "hovertemplate": f"{run}<br>%{{x}} running: %{{y:.1f}} tok/s<br>p50 step %{{customdata[1]:.2f}} ms, "
                              "n=%{customdata[0]} steps<extra></extra>",
             "meta": _meta("step_time_by_batch", "output_tok_per_s")} for run, rows in sorted(by_run.items())]
    return Chart("throughput-batch", "Decode throughput against batch size",
                 "Decode-only steps (no prefill) grouped by the number of running sequences.",
                 {"data": data, "layout": _layout("running sequences", "output tok/s", x_log=True)})


def latency_frontier(results, colors) -> Chart:
    rows = [r for r in _rows(results["latency_frontier"]) if r["itl_p99_s"] is not None]
    label = [f"{r['run_id']} (max_num_seqs {r['max_num_seqs']})" for r in rows]
    data = [{"type": "scatter", "mode": "markers+text", "name": "runs", "x": [_ms(r["itl_p99_s"]) for r in rows],
             "y": [r["output_tok_per_s"] for r in rows], "text": [str(r["max_num_seqs"]) for r in rows],
             "textposition": "top center", "customdata": label,
             "marker": {"size": 10, "color": [colors.get(r["run_id"]) for r in rows]},
             "hovertemplate": "%{customdata}<br>p99 ITL %{x:.2f} ms<br>%{y:.1f} tok/s<extra></extra>",
             "meta": _meta("latency_frontier", "itl_p99_s")}]
    front = sorted((r for r in rows if r["on_frontier"]), key=lambda r: r["itl_p99_s"])
    data.append({"type": "scatter", "mode": "lines", "name": "frontier", "line": {"dash": "dash", "color": "#555"},
                 "x": [_ms(r["itl_p99_s"]) for r in front], "y": [r["output_tok_per_s"] for r in front],
                 "hoverinfo": "skip", "meta": _meta("latency_frontier", "itl_p99_s", where="on_frontier")})
    return Chart("frontier", "Throughput against p99 ITL",
                 "One point per run, labelled with its max_num_seqs; the dashed line joins the runs nothing "
                 "beats on both axes. Pick the widest batch whose p99 you can accept.",
                 {"data": data, "layout": _layout("p99 ITL (ms)", "output tok/s", x_log=True)})


def run_delta(results, colors) -> Chart:
    rows = [r for r in _rows(results["run_delta"]) if r["run_id"] != r["baseline_run_id"]
            and r["delta_pct"] is not None]
    by_run = defaultdict(list)
    for r in rows:
        by_run[r["run_id"]].append(r)
    data = []
    for run, pts in sorted(by_run.items()):
        good = [(p["delta_pct"] > 0) == (p["better"] == "higher") or p["delta_pct"] == 0 for p in pts]
        data.append({"type": "bar", "name": f"{run} vs {pts[0]['baseline_run_id']}",
                     "x": [p["metric"] for p in pts], "y": [p["delta_pct"] * 100 for p in pts],
                     "marker": {"color": ["#2ca02c" if g else "#d62728" for g in good],
                                "line": {"color": colors.get(run), "width": 2}},
                     "customdata": [[p["value"], p["baseline_value"]] for p in pts],
                     "hovertemplate": "%{x}: %{customdata[0]:.4g} vs %{customdata[1]:.4g} (%{y:+.1f}%)<extra>"
                                      f"{run}</extra>",
                     "meta": _meta("run_delta", "delta_pct", where="not_baseline")})
    layout = _layout("", "change against the baseline (%)", barmode="group")
    layout["xaxis"]["type"] = "category"
    return Chart("run-delta", "Runs against the baseline",
                 "Green is better, red worse (more throughput, less latency). The first run given is the "
                 "baseline; the conditions that differ are highlighted in the table below.",
                 {"data": data, "layout": layout})


def output_lengths(results, colors) -> Chart:
    """The dataset page's histogram: rows by output length, one bar series per run."""
    by_run = defaultdict(list)
    for r in _rows(results["output_lengths"]):
        by_run[r["run_id"]].append(r)
    data = [{"type": "bar", "name": run, "marker": {"color": colors.get(run)}, "opacity": 0.75,
             "x": [r["bin_start"] for r in rows], "y": [r["n"] for r in rows],
             "width": [r["bin_width"] for r in rows], "offset": 0,
             "customdata": [r["bin_start"] + r["bin_width"] - 1 for r in rows],
             "hovertemplate": f"{run}<br>%{{x}}..%{{customdata}} tokens: %{{y}} rows<extra></extra>",
             "meta": _meta("output_lengths", "n")} for run, rows in sorted(by_run.items())]
    return Chart("output-lengths", "Output length",
                 "Rows by the number of tokens generated (generated and reused rows alike); a pile at the right "
                 "edge is rows cut off by max_tokens.",
                 {"data": data, "layout": _layout("output tokens", "rows", barmode="overlay")})


CHARTS = (itl_vs_context, itl_by_concurrency, ttft_cdf, step_timeline, throughput_over_time, throughput_by_batch,
          latency_frontier, run_delta, output_lengths)
DATASET_CHARTS = ("output-lengths",)  # drawn on the dataset page, not among the latency charts


def build_charts(results: dict[str, pa.Table]) -> list[Chart]:
    colors = _colors(results)
    return [make(results, colors) for make in CHARTS]
