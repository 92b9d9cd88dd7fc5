"""`--max-error-rate`: a run whose rows keep failing stops after the shard that shows it, in one line
naming the commonest reasons; what it committed stays, and the same command resumes once fixed."""

import json

from batchgen.cli import main
from batchgen.data.run_dir import RunDir

from conftest import cli_args, read_run_table, write_prompts


def test_a_failing_run_stops_naming_its_commonest_error_and_resumes_once_fixed(tmp_path, tiny_model_dir, capsys):
    prompts = ["", "", "", "fine", "", "", "fine", "fine", "fine", "fine", "fine", "fine"]  # '' is an error row
    inp = write_prompts(tmp_path / "in.parquet", prompts, ids=[f"r{i:02d}" for i in range(12)])
    args = [*cli_args(inp, tmp_path / "runs", tiny_model_dir, "r"), "--shard-by", "order"]
    assert main([*args, "--max-error-rate", "0.5", "--error-rate-min-rows", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("batchgen: error: 3 of the 4 rows so far became errors (75%), more than --max-error-rate 0.5")
    assert "'prompt is empty' (3)" in err and "run the same command to resume" in err
    run = RunDir(tmp_path / "runs" / "r")
    assert [m["shard"] for m in run.manifests()] == [0]  # the shard that showed it is committed; no more
    attempts = json.loads((tmp_path / "runs" / "r" / "run.json").read_text())["attempts"]
    assert attempts[-1]["status"] == "failed" and "max-error-rate" in attempts[-1]["detail"]
    # the cause "fixed" (here: a looser rate); the same run resumes and completes, every id once
    assert main([*args, "--max-error-rate", "0.9", "--error-rate-min-rows", "4"]) == 0
    ids = sorted(r["id"] for t in ("requests", "errors") for r in read_run_table(run.path, t).to_pylist())
    assert ids == [f"r{i:02d}" for i in range(12)]
