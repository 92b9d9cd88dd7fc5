"""`--max-hours` and `--max-cost`: a run stops at its budget, inside a shard if need be, keeps what it
committed, says how far it got, and the same command goes on to the end with every id once."""

import json
from dataclasses import replace

import pytest

from batchgen import budget
from batchgen.cli import main
from batchgen.config import EngineConfig, RunConfig, SamplingParams
from batchgen.data.run_dir import RunDir
from batchgen.runner import generate

from conftest import cli_args, read_run_table, write_prompts


class SteppedClock:
    """A test double for the wall clock the budget reads: real time, plus two hours once `jump_in`
    more readings have been taken."""

    def __init__(self):
        import time

        self.real, self.offset, self.jump_in = time.time, 0.0, None

    def time(self) -> float:
        if self.jump_in is not None:
            self.jump_in -= 1
            if self.jump_in <= 0:
                self.offset, self.jump_in = 7200.0, None
        return self.real() + self.offset


def test_a_run_stops_inside_a_shard_at_its_budget_and_resumes(tmp_path, tiny_model_dir, monkeypatch):
    clock = SteppedClock()
    monkeypatch.setattr(budget, "time", clock)
    ids = [f"r{i:02d}" for i in range(12)]
    inp = write_prompts(tmp_path / "in.parquet", [f"question {i}" for i in range(12)], ids=ids)
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(tmp_path / "runs"), run_id="b", model=str(tiny_model_dir),
                    shard_size=4, shard_by="order", max_hours=1.0, progress=False,
                    sampling=SamplingParams(max_tokens=6, repetition_stop="off"),
                    engine_config=EngineConfig(max_model_len=64, max_num_seqs=2))

    def after_shard(manifest):
        if manifest["shard"] == 0:
            clock.jump_in = 3  # shard 1's first check, its first step's, then past the budget in its second step

    with pytest.raises(budget.BudgetReached) as e:
        generate(cfg, on_shard=after_shard)
    assert str(e.value).startswith("the run reached its budget (--max-hours 1): 1 of 3 shards are committed "
                                   "(4 of 12 rows); the shard in progress was not committed")
    assert "--run-id b" in str(e.value)
    run = RunDir(tmp_path / "runs" / "b")
    assert [m["shard"] for m in run.manifests()] == [0]
    attempt = json.loads((tmp_path / "runs" / "b" / "run.json").read_text())["attempts"][-1]
    assert attempt["status"] == "stopped" and "--max-hours 1" in attempt["detail"]

    summary = generate(replace(cfg, max_hours=None))  # the same run, without a cap: to the end
    assert summary.resumed and summary.rows == 12
    got = sorted(r["id"] for t in ("requests", "errors") for r in read_run_table(run.path, t).to_pylist())
    assert got == ids


def test_the_cli_stops_with_its_own_status_and_a_cost_needs_a_price(tmp_path, tiny_model_dir, capsys):
    inp = write_prompts(tmp_path / "in.parquet", ["a question", "another"])
    args = cli_args(inp, tmp_path / "runs", tiny_model_dir, "c")
    assert main([*args, "--max-cost", "2"]) == 2
    assert "max_cost needs price_per_hour" in capsys.readouterr().err
    # 1e-9 USD at 1 USD an hour: 3.6 microseconds, spent before the first shard
    assert main([*args, "--max-cost", "1e-9", "--price-per-hour", "1"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("batchgen: stopped: the run reached its budget (--max-cost 1e-09 at --price-per-hour 1 ")
    assert "0 of 1 shards are committed (0 of 2 rows)" in err
    assert main(args) == 0  # the same run, no cap: done
    assert sorted(r["id"] for r in read_run_table(tmp_path / "runs" / "c", "requests").to_pylist()) == ["0", "1"]


def test_the_tighter_cap_wins():
    base = dict(inputs=("x.parquet",), output_dir="runs")
    assert budget.limit_s(RunConfig(**base)) is None
    assert budget.limit_s(RunConfig(**base, max_hours=2.0)) == 7200
    assert budget.limit_s(RunConfig(**base, max_hours=2.0, max_cost=3.0, price_per_hour=6.0)) == 1800
    assert budget.limit_s(RunConfig(**base, max_cost=3.0, price_per_hour=0.0)) is None  # a free machine: no cap
