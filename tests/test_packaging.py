"""Installed, not only checked out: the wheel carries sql/ and the held prompts, and `batchgen report`
runs from a directory outside the repository."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, cli_args

from batchgen.cli import main

pytestmark = pytest.mark.slow


def test_the_wheel_reports_from_outside_the_repo(tmp_path, tiny_model_dir):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("batchgen-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "batchgen/sql/views.sql" in names and "batchgen/sql/throughput.sql" in names
    assert "batchgen/benchmarks/data/held_tasks.jsonl" in names
    # the C++ kernels' sources (fp32 matmul, sampler): built on the machine that runs them
    assert {"batchgen/kernels/gemv.cpp", "batchgen/kernels/sample.cpp"} <= set(names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # a run to report on, made here; then the installed package reports it from an unrelated directory
    inp = tmp_path / "in.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["one", "two", "three"]}), inp)
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r")) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", "import batchgen.report.queries as q, sys; print(q.SQL_DIR); "
                        "from batchgen.cli import main; sys.exit(main(sys.argv[1:]))",
                        "report", str(tmp_path / "runs" / "r"), "--out", str(elsewhere / "rep")],
                       cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(site) in r.stdout.splitlines()[0]  # the installed copy, not the checkout's sql/
    assert (elsewhere / "rep" / "report.html").is_file()
