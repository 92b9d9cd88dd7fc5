"""A hub id (org/name) resolves through the local Hugging Face cache: no network here, so the test
lays the real model out as the hub's cache does and turns the hub off."""

import os
import subprocess
import sys

from batchgen.data.run_dir import RunDir

from conftest import REPO, write_prompts


def test_a_hub_id_runs_from_the_local_hugging_face_cache(tmp_path, real_model_dir):
    revision = "0" * 40
    repo = tmp_path / "hf" / "hub" / "models--batchgen-test--smollm2-135m"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in real_model_dir.iterdir():  # the hub's cache links snapshot files to blobs: links here too
        (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    inp = write_prompts(tmp_path / "in.parquet", ["Name a colour.", "Name a fruit."])
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "batchgen.cli", "generate", "--input", str(inp), "--output", str(tmp_path / "runs"),
            "--max-tokens", "4", "--no-progress"]
    proc = subprocess.run(args + ["--model", "batchgen-test/smollm2-135m", "--run-id", "hub"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 rows -> 2 outputs" in proc.stdout
    assert RunDir(tmp_path / "runs" / "hub").read_json()["model"] == str(snapshot)
    missing = subprocess.run(args + ["--model", "batchgen-test/absent", "--run-id", "x"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2
    assert "'batchgen-test/absent' is not a local directory, and neither the hub nor the local" in missing.stderr
