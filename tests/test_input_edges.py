"""Inputs at their edges: run ids that would leave the output root, globs and directories that hold
the wrong things, and valid Parquet encodings that must be accepted."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from batchgen.cli import main
from batchgen.config import ConfigError, RunConfig

from conftest import cli_args, read_run_table, write_prompts


@pytest.mark.parametrize("run_id", [".", "..", "../escape", "a/b", ".hidden"])
def test_run_ids_that_leave_the_output_root_are_refused_everywhere(tmp_path, tiny_model_dir, capsys, run_id):
    from batchgen.settings import GenerateSettings

    inp = write_prompts(tmp_path / "in.parquet", ["hello"])
    out = tmp_path / "root" / "runs"
    assert main(cli_args(inp, out, tiny_model_dir, run_id)) == 2
    assert "run_id" in capsys.readouterr().err
    assert not (tmp_path / "root").exists()  # nothing written, in the root or beside it
    with pytest.raises(ValidationError, match="run_id"):  # the Prefect form's model
        GenerateSettings(input=[str(inp)], output=str(out), run_id=run_id)
    with pytest.raises(ConfigError, match="plain directory name"):  # the library's own check
        RunConfig(inputs=(str(inp),), output_dir=str(out), run_id=run_id)


def test_a_glob_that_matches_only_directories_is_a_clear_error(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "data" / "part-a").mkdir(parents=True)
    (tmp_path / "data" / "part-b").mkdir()
    assert main(cli_args(str(tmp_path / "data" / "part-*"), tmp_path / "runs", tiny_model_dir, "r")) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"batchgen: error: {tmp_path / 'data' / 'part-*'}: no files match this glob"


def test_every_file_of_a_directory_must_have_the_prompt_column(tmp_path, tiny_model_dir, capsys):
    d = tmp_path / "ds"
    d.mkdir()
    write_prompts(d / "a.parquet", ["one", "two"], ids=["a1", "a2"])
    pq.write_table(pa.table({"id": ["b1"], "text": ["no prompt column here"]}), d / "b.parquet")
    assert main(cli_args(d, tmp_path / "runs", tiny_model_dir, "r")) == 2
    err = capsys.readouterr().err
    assert f"{d / 'b.parquet'}: no 'prompt' column, which the other input files have" in err
    assert not (tmp_path / "runs").exists()


def test_valid_encodings_and_safely_widening_schemas_are_accepted(tmp_path, tiny_model_dir):
    d = tmp_path / "ds"
    d.mkdir()
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int32()),
                             "prompt": pa.array(["one", "two"]).dictionary_encode()}), d / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([3, 4], pa.int64()),
                             "prompt": pa.array(["three", "four"], pa.large_string())}), d / "b.parquet")
    pq.write_table(pa.table({"id": pa.array([5], pa.int64()), "prompt": pa.array(["five"], pa.string()),
                             "max_tokens": pa.array([2], pa.int16())}), d / "c.parquet")
    assert main(cli_args(d, tmp_path / "runs", tiny_model_dir, "r")) == 0
    run = tmp_path / "runs" / "r"
    assert sorted(read_run_table(run, "requests").column("id").to_pylist()) == ["1", "2", "3", "4", "5"]
    assert (run / "_SUCCESS").is_file()
