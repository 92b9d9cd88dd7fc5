"""The run contract: SIGKILL at any point, resume, exactly-once output, locks and identity."""

import json
from pathlib import Path
import os
import signal
import subprocess
import sys

import pytest

from batchgen.cli import main
from batchgen.data.run_dir import RunDir, RunError

from conftest import cli_args, read_run_table, run_cli_subprocess, write_prompts

N_ROWS = 11


@pytest.fixture
def dataset(tmp_path):
    prompts = [f"prompt number {i} " + "x " * (i % 4) for i in range(N_ROWS - 1)] + [""]  # one row error
    return write_prompts(tmp_path / "in.parquet", prompts, ids=[f"id{i:02d}" for i in range(N_ROWS)])


def outputs(run_dir):
    def rows(t):
        return read_run_table(run_dir, t).to_pylist()

    return rows("requests"), rows("errors"), rows("tokens")


@pytest.mark.parametrize("kill_at", ["step:3", "commit-staged:2", "commit-published:1", "shard-done:2"])
def test_sigkill_then_resume_gives_exactly_once(tmp_path, dataset, tiny_model_dir, kill_at):
    out = tmp_path / "runs"
    killed = run_cli_subprocess(cli_args(dataset, out, tiny_model_dir, "crash"), kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = out / "crash"
    assert not (run / "_SUCCESS").exists()
    assert (run / ".lock").exists()  # left behind by the dead process: stale, must be taken over

    resumed = run_cli_subprocess(cli_args(dataset, out, tiny_model_dir, "crash"))
    assert resumed.returncode == 0, resumed.stderr
    assert "(resumed)" in resumed.stdout and (run / "_SUCCESS").is_file()

    assert main(cli_args(dataset, out, tiny_model_dir, "clean")) == 0
    req, err, tok = outputs(run)
    ref_req, ref_err, _ = outputs(out / "clean")
    ids = [r["id"] for r in req] + [e["id"] for e in err]
    assert sorted(ids) == [f"id{i:02d}" for i in range(N_ROWS)]  # every row once, no duplicates
    assert len(tok) == sum(r["output_tokens"] for r in req)  # no token rows from the killed attempt
    assert {r["id"]: r["output_token_ids"] for r in req} == {r["id"]: r["output_token_ids"] for r in ref_req}
    assert [e["id"] for e in err] == [e["id"] for e in ref_err] == ["id10"]
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert len(attempts) == 2


def test_changed_settings_under_the_same_run_id_are_refused(tmp_path, dataset, tiny_model_dir, capsys):
    out = tmp_path / "runs"
    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 0
    assert main(cli_args(dataset, out, tiny_model_dir, "r") + ["--temperature", "0.5"]) == 2
    assert "started with a different sampling" in capsys.readouterr().err
    write_prompts(dataset, ["other input"])
    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 2
    assert "different input (its files' content changed)" in capsys.readouterr().err
    assert not (out / "r" / ".lock").exists()


def test_rerun_of_a_finished_run_does_no_work(tmp_path, dataset, tiny_model_dir, capsys):
    out = tmp_path / "runs"
    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 0
    capsys.readouterr()
    assert main(cli_args(dataset, out, tiny_model_dir, "r")) == 0
    stdout = capsys.readouterr().out
    assert "(resumed)" in stdout and "0 tokens generated" in stdout


def test_a_live_lock_is_refused_and_names_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = RunDir(tmp_path / "r")
        Path(run.path).mkdir()
        (Path(run.path) / ".lock").write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename, "since": 0}))
        with pytest.raises(RunError, match=f"locked by pid {holder.pid}"):
            run.open({"x": 1})
    finally:
        holder.kill()
        holder.wait()
    run.open({"x": 1})  # the holder is dead now: its lock is stale and taken over
    assert json.loads((Path(run.path) / ".lock").read_text())["pid"] == os.getpid()
    run.unlock()
