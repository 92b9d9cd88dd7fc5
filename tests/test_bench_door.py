"""`batchgen bench NAME`: one door to every benchmark program, found in batchgen.benchmarks."""

from pathlib import Path

import batchgen.benchmarks as benchmarks
from batchgen.cli import main

from conftest import cli_args, write_prompts


def test_bench_help_lists_every_benchmark_program(capsys):
    on_disk = sorted(p.stem for p in Path(benchmarks.__file__).parent.glob("*.py")
                     if not p.stem.startswith("_") and 'if __name__ == "__main__"' in p.read_text())
    assert sorted(benchmarks.programs()) == on_disk and "loops" in on_disk and "judge" in on_disk
    try:
        main(["bench", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "batchgen bench NAME" in out
    assert all(f"  {name} " in out for name in on_disk)


def test_a_benchmark_runs_through_the_door_and_a_wrong_name_is_one_line(tmp_path, tiny_model_dir, capsys):
    inp = write_prompts(tmp_path / "in.parquet", ["one question", "another question"])
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r", "--repetition-stop", "off")) == 0
    capsys.readouterr()
    assert main(["bench", "loops", str(tmp_path / "runs" / "r")]) == 0
    assert capsys.readouterr().out.startswith("2 rows, 8 output tokens; the repetition rule fires on 0 rows")
    assert main(["bench", "loopz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchgen bench: error: no benchmark 'loopz'; did you mean 'loops'?")
