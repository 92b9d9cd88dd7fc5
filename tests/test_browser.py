"""In a real headless Chromium:
- the report, opened with the network cut off: no console errors, and every chart has drawn exactly
  the points its query returned (counted in the browser, against the query's Parquet file);
- the Prefect UI of a local server serving our deployments: the on-demand deployment's form filled in
  and submitted like a person would, the run followed to Completed, its artifacts on its page.
Skips where no browser is installed; CI sets BATCHGEN_REQUIRE_BROWSER=1, which makes that a failure."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pyarrow.parquet as pq
import pytest

from batchgen.cli import main
from batchgen.report.queries import QUERIES

from conftest import (REPO, PageWatch, make_run, prefect_server_env, read_run_table, screenshot_dir, wait_until,
                      write_prompts)

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


def test_the_dataset_page_shows_text_as_text_and_searches_and_sorts(chromium, tmp_path, tiny_model_dir):
    """A prompt that is a script tag shows as text in the sample of rows: no script runs (no dialog),
    no console error; the search box filters the rows and a header click sorts them."""
    script = "<script>alert(1)</script>"
    prompts = [script, "<img src=x onerror=alert(2)>", "a plain question", "another question", "third one"]
    inp = write_prompts(tmp_path / "in.parquet", prompts, ids=[f"x{i}" for i in range(5)],
                        max_tokens=[5, 1, 3, 2, 4])
    assert main(["generate", "--input", str(inp), "--output", str(tmp_path), "--run-id", "ds", "--model",
                 str(tiny_model_dir), "--max-model-len", "64", "--keep-columns", "prompt", "--no-progress",
                 "--ignore-eos"]) == 0
    assert main(["report", str(tmp_path / "ds"), "--out", str(tmp_path / "rep")]) == 0
    page = chromium.new_page()
    watch, dialogs = PageWatch(page), []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto((tmp_path / "rep" / "report.html").as_uri())
    page.wait_for_selector("#sample-rows")
    cells = page.eval_on_selector_all("#sample-rows tbody td", "tds => tds.map(td => td.textContent)")
    assert script in cells and "<img src=x onerror=alert(2)>" in cells  # shown as the text it is
    assert page.eval_on_selector_all("#sample-rows script, #sample-rows img", "els => els.length") == 0
    page.fill("#sample-search", "plain")
    visible = page.eval_on_selector_all("#sample-rows tbody tr", "trs => trs.filter(t => t.style.display !== 'none')"
                                                                 ".map(t => t.cells[1].textContent)")
    assert visible == ["x2"] and page.text_content("#sample-count") == "1"
    page.fill("#sample-search", "")
    header = page.eval_on_selector_all("#sample-rows thead th", "ths => ths.map(t => t.textContent)")
    col = header.index("output_tokens")
    page.click(f"#sample-rows thead th:nth-child({col + 1})")
    lengths = page.eval_on_selector_all("#sample-rows tbody tr", f"trs => trs.map(t => +t.cells[{col}].textContent)")
    assert lengths == sorted(lengths) == [1, 2, 3, 4, 5]
    page.click(f"#sample-rows thead th:nth-child({col + 1})")  # again: descending
    assert page.eval_on_selector_all("#sample-rows tbody tr", f"trs => trs.map(t => +t.cells[{col}].textContent)") \
        == [5, 4, 3, 2, 1]
    assert dialogs == [] and watch.errors == []


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
        for key in ("step-timeline", "frontier"):
            page.locator(f"section:has(#{key})").screenshot(path=str(screenshot_dir() / f"report-{key}.png"))
    context.close()


# the form's fields, by the titles GenerateSettings gives them (what a person reads on the page)
FORM_FIELDS = {"input": "Input", "output": "Output root (Optional)", "run_id": "Run id (Optional)",
               "model": "Model (Optional)", "engine": "Engine (Optional)",
               "max_tokens": "Max new tokens per row (a row's max_tokens column wins) (Optional)",
               "max_num_seqs": "Max sequences per decode batch (Optional)",
               "max_model_len": "Max positions per sequence (Optional)", "shard_size": "Rows per shard (Optional)"}
TAG_FIELD_JS = """([label, tag]) => {
  const span = [...document.querySelectorAll('.schema-form-property__label')].find(s => s.textContent.trim() === label);
  if (!span) return false;
  span.closest('.schema-form-property').setAttribute('data-field', tag);
  return true;
}"""


@pytest.fixture(scope="module")
def served_ui(tmp_path_factory):
    """A Prefect server with its UI, and flows/serve.py serving the deployments to it."""
    home = tmp_path_factory.mktemp("prefect-ui-home")
    with prefect_server_env(home, ui=True) as env:
        log = open(home / "serve.log", "w")
        served = subprocess.Popen([sys.executable, "-m", "flows.serve"], env=env, cwd=REPO, stdout=log,
                                  stderr=subprocess.STDOUT)
        api = env["PREFECT_API_URL"]

        def deployment_id():
            with urllib.request.urlopen(f"{api}/deployments/name/batchgen-pipeline/on-demand", timeout=5) as r:
                return json.load(r)["id"]

        try:
            wait_until(deployment_id, 180, "the served on-demand deployment")
            yield api.removesuffix("/api"), deployment_id(), home / "serve.log"
        finally:
            served.terminate()
            served.wait(30)
            log.close()


@pytest.mark.heavy
def test_on_demand_form_in_the_prefect_ui_runs_to_completion(chromium, served_ui, tmp_path, tiny_model_dir):
    ui, deployment, serve_log = served_ui
    inp = write_prompts(tmp_path / "in.parquet", [f"what is {i} + {i}?" for i in range(5)],
                        ids=[f"u{i}" for i in range(5)])
    page = chromium.new_page(viewport={"width": 1400, "height": 1000})
    watch = PageWatch(page)
    page.goto(f"{ui}/deployments")
    page.get_by_role("link", name="on-demand").first.click()  # from the list, as a person would
    page.wait_for_url(f"**/deployments/deployment/{deployment}*")
    page.goto(f"{ui}/deployments/deployment/{deployment}/run")  # the "Run > Custom run" form
    page.get_by_text("Max sequences per decode batch").first.wait_for(timeout=60_000)

    def field(tag):  # tagged afresh each time: the form re-renders a field when its type is switched
        assert page.evaluate(TAG_FIELD_JS, [FORM_FIELDS[tag], tag]), f"no field titled {FORM_FIELDS[tag]!r}"
        return page.locator(f"[data-field={tag}]")

    # every field of the form has a description (one of the form's stated qualities)
    described = page.evaluate("""() => [...document.querySelectorAll('.schema-form-property')]
        .filter(p => !p.querySelector('.schema-form-property'))
        .map(p => [p.querySelector('.schema-form-property__label')?.textContent.trim(),
                   !!p.querySelector('.schema-form-property__description')])""")
    assert described and all(has for _, has in described), [name for name, has in described if not has]

    run_name = "ui-form-run"
    page.locator("input[type=text]").first.fill(run_name)  # Run Name, above the parameters
    field("input").get_by_role("button", name="Add item").click()
    field("input").locator("textarea").fill(str(inp))
    field("output").locator("textarea").fill(str(tmp_path / "runs"))
    field("run_id").get_by_role("button", name="str", exact=True).click()
    field("run_id").locator("textarea").fill("from-the-form")
    field("model").locator("textarea").fill(str(tiny_model_dir))
    field("engine").locator("button.p-select-button__control").focus()
    page.keyboard.press("ArrowDown")
    page.get_by_role("option", name="native", exact=True).click()
    for tag, value in (("max_tokens", "3"), ("max_num_seqs", "2"), ("max_model_len", "64"), ("shard_size", "2")):
        field(tag).locator("input").fill(value)
    if screenshot_dir():
        field("input").scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot_dir() / "prefect-form.png"))
    page.get_by_role("button", name="Submit").click()

    # waits, not speed checks: the UI navigates slowly on a 2-core machine running the suite beside it
    page.wait_for_url("**/deployments/deployment/**tab=Runs", timeout=120_000)
    page.get_by_text(run_name).first.click()
    page.wait_for_url("**/runs/flow-run/**", timeout=120_000)
    completed = page.locator(".state-badge.state--completed")
    try:
        completed.first.wait_for(timeout=300_000)
    except Exception:
        raise AssertionError(serve_log.read_text()[-4000:]) from None
    page.locator("li.p-tab", has_text="Artifacts").click()
    for key in ("batchgen-headline", "batchgen-latency", "batchgen-report-html"):
        page.get_by_text(key).first.wait_for(timeout=30_000)
    assert watch.errors == [], watch.errors

    run_dir = tmp_path / "runs" / "from-the-form"
    assert (run_dir / "_SUCCESS").is_file() and (run_dir / "report" / "report.html").is_file()
    assert sorted(read_run_table(run_dir, "requests").column("id").to_pylist()) == [f"u{i}" for i in range(5)]
    cond = json.loads((run_dir / "run.json").read_text())["conditions"]["engine"]
    assert cond["max_num_seqs"] == 2 and cond["engine"] == "native"
