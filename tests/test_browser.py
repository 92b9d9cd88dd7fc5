"""The report, opened in a real headless Chromium with the network cut off: no console errors, and every
chart has drawn exactly the points its query returned (counted in the browser, against the query's
Parquet file). Skips where no browser is installed, fails then in CI (BATCHGEN_REQUIRE_BROWSER=1)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from batchgen.cli import main
from batchgen.report.queries import QUERIES

from conftest import PageWatch, make_run, screenshot_dir

# per drawn point, which rows of the query a trace draws (charts.py's `meta.filter`)
FILTERS = {
    None: lambda r, col: r[col] is not None,
    "nonzero": lambda r, col: bool(r[col]),
    "on_frontier": lambda r, col: r[col] is not None and r["on_frontier"],
    "not_baseline": lambda r, col: r[col] is not None and r["run_id"] != r["baseline_run_id"],
}

# what Plotly computed for each trace (calcdata: what it draws), counted per trace type
COUNT_JS = """
(id) => {
  const gd = document.getElementById(id);
  const finite = (v) => typeof v === 'number' && Number.isFinite(v);
  return {
    svg: gd.querySelectorAll('.main-svg').length,
    axes: Object.fromEntries(Object.entries(gd._fullLayout).filter(([k]) => /^[xy]axis\\d*$/.test(k))
                               .map(([k, a]) => [k, a.type])),
    traces: gd.calcdata.map((cd, i) => {
      const t = gd._fullData[i];
      const ok = (p) => t.type === 'box' ? finite(p.med) : t.type === 'bar' ? finite(p.p) && finite(p.s)
                                                                         : finite(p.x) && finite(p.y);
      return {meta: t.meta, type: t.type, n: cd.filter(ok).length};
    }),
  };
}
"""


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("browser-runs")
    runs = [make_run(root, tiny_model_dir, f"mns{n}", n) for n in (1, 2, 4)]
    out = root / "report"
    assert main(["report", *map(str, runs), "--out", str(out), "--price-per-hour", "3.2"]) == 0
    return out


def expected_points(out, meta) -> int:
    rows = pq.read_table(out / f"{meta['query']}.parquet").to_pylist()
    keep = FILTERS[meta.get("filter")]
    return sum(1 for r in rows if keep(r, meta["column"]))


def test_report_draws_every_point_offline_without_errors(chromium, report_dir):
    context = chromium.new_context(viewport={"width": 1280, "height": 900}, offline=True)
    outside = []

    def only_local(route):  # the network is cut: anything not from the file itself is refused and recorded
        if route.request.url.startswith(("file:", "data:", "blob:")):
            return route.continue_()
        outside.append(route.request.url)
        return route.abort()

    context.route("**/*", only_local)
    page = context.new_page()
    watch = PageWatch(page)
    page.goto((report_dir / "report.html").as_uri())
    charts = page.eval_on_selector_all("div.chart", "els => els.map(e => e.id)")
    assert len(charts) >= 8
    page.wait_for_function(f"document.querySelectorAll('div.chart.js-plotly-plot').length === {len(charts)}",
                           timeout=30_000)
    drawn = {key: page.evaluate(COUNT_JS, key) for key in charts}

    assert watch.errors == [] and watch.failed == [] and outside == []
    for key, chart in drawn.items():
        assert chart["svg"] >= 1, key
        totals: dict[tuple, int] = {}
        for t in chart["traces"]:
            assert t["meta"]["query"] in QUERIES, (key, t["meta"])
            ident = (t["meta"]["query"], t["meta"]["column"], t["meta"].get("filter"))
            totals[ident] = totals.get(ident, 0) + t["n"]
        for ident, n in totals.items():
            want = expected_points(report_dir, dict(zip(("query", "column", "filter"), ident)))
            assert n == want, (key, ident, n, want)
        assert sum(totals.values()) > 0, f"{key} drew nothing"
    # heavy-tailed latencies on log axes
    assert drawn["itl-context"]["axes"]["yaxis"] == "log" and drawn["ttft-cdf"]["axes"]["xaxis"] == "log"
    assert drawn["step-timeline"]["axes"]["yaxis2"] == "log" and drawn["frontier"]["axes"]["xaxis"] == "log"

    # hover gives the exact value: hovering the first frontier point shows its throughput
    frontier = pq.read_table(report_dir / "latency_frontier.parquet").to_pylist()
    page.evaluate("Plotly.Fx.hover('frontier', [{curveNumber: 0, pointNumber: 0}])")
    label = page.evaluate("document.querySelector('#frontier .hoverlayer').textContent")
    assert f"{frontier[0]['output_tok_per_s']:.1f} tok/s" in label
    # zoom: a relayout narrows the axis and the chart redraws without error
    page.evaluate("Plotly.relayout('throughput-time', {'xaxis.range': [0, 0.05]})")
    assert page.evaluate("document.getElementById('throughput-time')._fullLayout.xaxis.range[1]") == 0.05
    assert watch.errors == []
    if screenshot_dir():
        page.set_viewport_size({"width": 1280, "height": 1000})
        page.locator("#step-timeline").scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot_dir() / "report.png"), full_page=False)
    context.close()
