"""The DuckDB reports against an independent numpy computation of the same METRICS.md definitions."""

import json
import math
from collections import defaultdict

import numpy as np
import pytest

from batchgen.cli import main
from batchgen.report.build import build_report
from batchgen.report.queries import QUERIES, ReportError, connect, run_query

from conftest import make_run, read_run_table, write_prompts


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("runs")
    return make_run(root, tiny_model_dir, "a", 3), make_run(root, tiny_model_dir, "b", 2)


def table(run, name):
    return read_run_table(run, name).to_pylist()


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q * 100, method="linear"))


def by(rows, *keys):
    return {tuple(r[k] for k in keys): r for r in rows}


def test_request_latency_matches_numpy(runs):
    run = runs[0]
    got = by(run_query(connect([run]), "request_latency").to_pylist(), "metric")
    req = table(run, "requests")
    for metric in ("queue_s", "ttft_s", "prefill_s", "tpot_s", "e2e_s"):
        vals = [r[metric] for r in req if r[metric] is not None]
        row = got[(metric,)]
        assert row["n"] == len(vals)
        for q, col in ((0.5, "p50_s"), (0.9, "p90_s"), (0.95, "p95_s"), (0.99, "p99_s")):
            assert row[col] == pytest.approx(pct(vals, q), rel=1e-9, abs=1e-12)
        assert row["mean_s"] == pytest.approx(np.mean(vals)) and row["max_s"] == pytest.approx(max(vals))
    assert got[("tpot_s",)]["n"] == len(req) - 1  # the single-token request has no TPOT


def test_itl_buckets_match_numpy(runs):
    run = runs[0]
    got = by(run_query(connect([run]), "itl_by_context_concurrency").to_pylist(), "context_lo", "concurrency_lo")
    groups = defaultdict(list)
    for t in table(run, "tokens"):
        if t["itl_s"] is None:
            continue
        ctx = 0 if t["context_len"] < 128 else 2 ** int(math.floor(math.log2(t["context_len"])))
        groups[(ctx, 2 ** int(math.floor(math.log2(t["concurrency"]))))].append(t["itl_s"])
    assert set(got) == set(groups) and len(groups) >= 2
    for key, vals in groups.items():
        row = got[key]
        assert row["n"] == len(vals)
        assert row["p50_s"] == pytest.approx(pct(vals, 0.5)) and row["p99_s"] == pytest.approx(pct(vals, 0.99))
        assert row["concurrency_hi"] == 2 * key[1] - 1


def test_throughput_and_windows_match_numpy(runs):
    run = runs[0]
    con = connect([run], window_s=0.05)
    (got,) = run_query(con, "throughput").to_pylist()
    req, steps, toks = table(run, "requests"), table(run, "steps"), table(run, "tokens")
    window = max(s["end_t"] for s in steps) - min(s["start_t"] for s in steps)
    n_out = sum(r["output_tokens"] for r in req)
    assert got["output_tokens"] == n_out == len(toks)
    assert got["output_tok_per_s"] == pytest.approx(n_out / window)
    assert got["total_tok_per_s"] == pytest.approx((n_out + sum(r["prompt_tokens"] for r in req)) / window)
    assert got["requests_per_s"] == pytest.approx(len(req) / window)
    over_time = run_query(con, "throughput_over_time").to_pylist()
    counts = np.bincount(np.floor(np.array([t["t"] for t in toks]) / 0.05).astype(int))
    assert {round(r["window_start_t"] / 0.05): r["output_tokens"] for r in over_time} == \
        {i: int(c) for i, c in enumerate(counts) if c}


def test_step_queries_and_mbu(runs):
    run = runs[0]
    con = connect([run])
    peak = json.loads((run / "run.json").read_text())["conditions"]["hardware"]["peak_read_bytes_per_s"]
    timeline = run_query(con, "step_timeline").to_pylist()
    steps = table(run, "steps")
    assert len(timeline) == len(steps)
    for r in timeline:
        assert r["mbu"] == pytest.approx(r["bytes_read"] / (r["end_t"] - r["start_t"]) / peak)
    by_batch = by(run_query(con, "step_time_by_batch").to_pylist(), "num_running")
    decode = defaultdict(list)
    for s in steps:
        if s["num_prefill_tokens"] == 0:
            decode[s["num_running"]].append(s["end_t"] - s["start_t"])
    assert set(by_batch) == {(k,) for k in decode}
    for k, vals in decode.items():
        assert by_batch[(k,)]["p50_step_s"] == pytest.approx(pct(vals, 0.5))
        assert by_batch[(k,)]["output_tok_per_s"] == pytest.approx(k * len(vals) / sum(vals))


def test_ttft_cdf_is_100_exact_quantiles(runs):
    run = runs[0]
    rows = run_query(connect([run]), "ttft_cdf").to_pylist()
    ttft = [r["ttft_s"] for r in table(run, "requests")]
    assert len(rows) == 100
    for r in rows[::17]:
        assert r["ttft_s"] == pytest.approx(pct(ttft, r["fraction"]))


def test_two_runs_side_by_side_show_what_differs(runs):
    con = connect(list(runs))
    cmp = by(run_query(con, "run_comparison").to_pylist(), "run_id")
    assert set(cmp) == {("a",), ("b",)}
    assert "max_num_seqs=3" in cmp[("a",)]["differing_conditions"]
    assert "max_num_seqs=2" in cmp[("b",)]["differing_conditions"]
    assert "engine=" not in cmp[("a",)]["differing_conditions"]
    lat = run_query(con, "request_latency").to_pylist()
    assert {r["run_id"] for r in lat} == {"a", "b"}


def test_single_token_requests_give_empty_groups_not_errors(tmp_path, tiny_model_dir):
    run = make_run(tmp_path, tiny_model_dir, "ones", 3, max_tokens="1", n=4)
    con = connect([run])
    lat = by(run_query(con, "request_latency").to_pylist(), "metric")
    assert lat[("tpot_s",)]["n"] == 0 and lat[("tpot_s",)]["p50_s"] is None
    assert run_query(con, "itl_by_concurrency").num_rows == 0
    (tp,) = run_query(con, "throughput").to_pylist()
    assert tp["output_tokens"] == 4


def test_report_cli_writes_tables_and_an_offline_html(runs, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", str(runs[0]), str(runs[1]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "output_tok_per_s" in printed and "ttft_s" in printed
    for name in QUERIES:
        assert (out / f"{name}.parquet").is_file() and (out / f"{name}.csv").is_file()
    page = (out / "report.html").read_text()
    # one inlined Plotly bundle, nothing fetched: no script or stylesheet from anywhere
    # three inline scripts (Plotly, the charts, the sample table's search and sort), nothing fetched
    assert page.count("<script>") == 3 and "<script src" not in page and "<link" not in page
    assert page.count("Plotly.newPlot") == 1 and page.count("<div class=chart") == len(build_charts_for(out))
    # every chart and table is captioned with its conditions (the conditions table is the conditions)
    # less the headline, the conditions and the rows (generated / reused / errors: counts, not measurements)
    assert page.count("Run conditions —") == page.count("<section>") - 3


def build_charts_for(out):
    import pyarrow.parquet as pq

    from batchgen.report.charts import build_charts

    return build_charts({name: pq.read_table(out / f"{name}.parquet") for name in QUERIES if name != "step_timeline"})


def test_not_a_run_directory(tmp_path):
    with pytest.raises(ReportError, match="not a run directory"):
        connect([tmp_path])


def test_queries_work_from_plain_duckdb_sql(runs):
    """What an analyst does in the duckdb CLI: set the variable, read views.sql, run a query file."""
    import duckdb

    from batchgen.report.queries import SQL_DIR

    con = duckdb.connect()
    con.execute(f"set variable runs = ['{runs[0]}']")
    con.execute((SQL_DIR / "views.sql").read_text())
    rows = con.sql((SQL_DIR / "request_latency.sql").read_text()).fetchall()
    assert len(rows) == 5


def test_kv_cache_query_sums_the_steps(tmp_path, tiny_model_dir):
    system = "You are a careful assistant. " * 6
    inp = write_prompts(tmp_path / "in.parquet", [system + f"question {i}?" for i in range(6)],
                        ids=[f"p{i}" for i in range(6)])
    assert main(["generate", "--input", str(inp), "--output", str(tmp_path), "--run-id", "kv", "--model",
                 str(tiny_model_dir), "--max-tokens", "12", "--max-model-len", "128", "--max-num-seqs", "2",
                 "--kv-cache-tokens", "96", "--block-size", "8", "--ignore-eos", "--no-progress"]) == 0
    run = tmp_path / "kv"
    (row,) = run_query(connect([run]), "kv_cache").to_pylist()
    steps, req = table(run, "steps"), table(run, "requests")
    assert row["num_preemptions"] == sum(s["num_preempted"] for s in steps)
    assert row["requests_preempted"] == sum(1 for r in req if r["num_preemptions"] > 0)
    assert row["prefix_cached_tokens"] == sum(s["num_cached_tokens"] for s in steps) > 0  # the shared system prompt
    assert row["prefix_hit_rate"] == pytest.approx(row["prefix_cached_tokens"] / sum(s["num_lookup_tokens"] for s in steps))
    assert row["peak_kv_blocks_used"] == max(s["kv_blocks_used"] for s in steps) <= row["kv_blocks_total"] == 12


def test_pooled_itl_matches_numpy(runs):
    rows = by(run_query(connect(list(runs)), "itl_overall").to_pylist(), "run_id")
    for run in runs:
        vals = [t["itl_s"] for t in table(run, "tokens") if t["itl_s"] is not None]
        row = rows[(run.name,)]
        assert row["n"] == len(vals) and row["max_s"] == pytest.approx(max(vals))
        for q, col in ((0.5, "p50_s"), (0.9, "p90_s"), (0.95, "p95_s"), (0.99, "p99_s")):
            assert row[col] == pytest.approx(pct(vals, q))


def test_step_windows_aggregate_min_max_and_sums_never_thin(runs):
    run = runs[0]
    con = connect([run])
    steps = sorted(table(run, "steps"), key=lambda s: (s["start_t"], s["step_id"]))
    one_each = run_query(con, "step_windows").to_pylist()
    assert len(one_each) == len(steps) and all(w["steps"] == 1 for w in one_each)  # under 1000 steps: every step
    con.execute("set variable step_windows = 7")
    windows = run_query(con, "step_windows").to_pylist()
    groups = defaultdict(list)
    for i, s in enumerate(steps):
        groups[i * 7 // len(steps)].append(s)
    assert [w["window_index"] for w in windows] == sorted(groups) and len(windows) == 7
    for w in windows:
        g = groups[w["window_index"]]
        step_s = [s["end_t"] - s["start_t"] for s in g]
        assert w["steps"] == len(g) and w["start_t"] == g[0]["start_t"]
        assert (w["min_running"], w["max_running"]) == (min(s["num_running"] for s in g),
                                                        max(s["num_running"] for s in g))
        assert w["max_step_s"] == pytest.approx(max(step_s)) and w["min_step_s"] == pytest.approx(min(step_s))
        for col, src in (("prefill_tokens", "num_prefill_tokens"), ("decode_tokens", "num_decode_tokens"),
                         ("preemptions", "num_preempted"), ("prefix_cached_tokens", "num_cached_tokens")):
            assert w[col] == sum(s[src] for s in g)
    assert sum(w["steps"] for w in windows) == len(steps)


def test_frontier_marks_the_runs_nothing_beats(runs):
    con = connect(list(runs))
    rows = run_query(con, "latency_frontier").to_pylist()
    tp = {r["run_id"]: r["output_tok_per_s"] for r in run_query(con, "throughput").to_pylist()}
    p99 = {r["run_id"]: r["p99_s"] for r in run_query(con, "itl_overall").to_pylist()}
    assert [r["max_num_seqs"] for r in rows] == sorted(r["max_num_seqs"] for r in rows)
    for r in rows:
        assert r["output_tok_per_s"] == pytest.approx(tp[r["run_id"]]) and r["itl_p99_s"] == pytest.approx(p99[r["run_id"]])
        beaten = any(tp[o] >= tp[r["run_id"]] and p99[o] <= p99[r["run_id"]]
                     and (tp[o] > tp[r["run_id"]] or p99[o] < p99[r["run_id"]]) for o in tp if o != r["run_id"])
        assert r["on_frontier"] == (not beaten)
    assert any(r["on_frontier"] for r in rows)


def test_run_delta_against_the_first_run_given(runs):
    for order in (list(runs), list(reversed(runs))):
        con = connect(order)
        cmp = by(run_query(con, "run_comparison").to_pylist(), "run_id")
        base = order[0].name
        rows = run_query(con, "run_delta").to_pylist()
        assert {r["baseline_run_id"] for r in rows} == {base}
        assert len(rows) == 8 * len(order)
        for r in rows:
            value, ref = cmp[(r["run_id"],)][r["metric"]], cmp[(base,)][r["metric"]]
            assert r["value"] == pytest.approx(value) and r["delta"] == pytest.approx(value - ref)
            assert r["delta_pct"] == pytest.approx((value - ref) / ref)
        assert by(rows, "run_id", "metric")[(base, "output_tok_per_s")]["delta"] == 0


def test_conditions_diff_flags_exactly_what_differs(runs):
    con = connect(list(runs))
    cond = {r["run_id"]: r for r in run_query(con, "run_conditions").to_pylist()}
    rows = run_query(con, "run_conditions_diff").to_pylist()
    flagged = {r["condition"] for r in rows if r["differs"]}
    expected = {k for k in cond["a"] if k != "run_id" and str(cond["a"][k]) != str(cond["b"][k])}
    assert flagged == expected and "max_num_seqs" in flagged and "engine" not in flagged
    assert {r["condition"] for r in rows} == set(cond["a"]) - {"run_id"}


def test_cost_per_million_tokens_from_the_attempts(runs, tmp_path):
    run = runs[0]
    doc = json.loads((run / "run.json").read_text())
    machine_s = sum(a["ended_wall"] - a["started_wall"] for a in doc["attempts"])
    (tp,) = run_query(connect([run]), "throughput").to_pylist()
    (free,) = run_query(connect([run]), "cost").to_pylist()
    assert free["cost"] is None and free["cost_per_million_output_tokens"] is None
    assert free["machine_s"] == pytest.approx(machine_s) and free["output_tokens"] == tp["output_tokens"]
    (paid,) = run_query(connect([run], price_per_hour=2.5), "cost").to_pylist()
    assert paid["cost"] == pytest.approx(2.5 * machine_s / 3600)
    assert paid["cost_per_million_output_tokens"] == pytest.approx(2.5 * machine_s / 3600 / tp["output_tokens"] * 1e6)
    assert paid["generation_cost_per_million_output_tokens"] == pytest.approx(
        2.5 * tp["window_s"] / 3600 / tp["output_tokens"] * 1e6)
    with pytest.raises(ReportError, match="price-per-hour"):
        connect([run], price_per_hour=-1)
    assert main(["report", str(run), "--out", str(tmp_path / "r"), "--price-per-hour", "2.5"]) == 0
