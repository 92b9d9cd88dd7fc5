"""--shard-by: rows grouped by the prefix they share before they are cut into shards (batchgen.data.order)."""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import cli_args, read_run_table, run_cli_subprocess


def systems(k: int) -> list[str]:
    return [f"You are assistant {j}. " + " ".join(f"rule{j}-{w}" for w in range(60)) for j in range(k)]


def prefix_rows(n: int, k: int = 8, seed: int = 0, ids: bool = True) -> list[dict]:
    """n rows in random order, each one of k system prompts (~700 bytes) and a short question."""
    rng = random.Random(seed)
    sys_ = systems(k)
    rows = [{"system": sys_[rng.randrange(k)], "prompt": f"question {i}: what is {rng.randrange(1000)}?"}
            for i in range(n)]
    return [{"id": f"r{i:04d}", **r} for i, r in enumerate(rows)] if ids else rows


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=37)  # row groups that no shard lines up with
    return path


def test_leading_text_of_each_input_shape():
    from batchgen.data.order import leading_text

    t = pa.table({"system": ["be brief", None], "prompt": ["hello", "bye"]})
    assert leading_text(t, "prompt").to_pylist() == [b"be brief\x00hello", b"\x00bye"]
    assert leading_text(t, "prompt", limit=4).to_pylist() == [b"be b", b"\x00bye"]
    msgs = pa.array([[{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
                     [{"role": "user", "content": "yo"}], None])
    assert leading_text(pa.table({"messages": msgs.slice(0)}), "messages").to_pylist() == [b"\x00S\x00hi", b"\x00yo",
                                                                                          b"\x00"]
    assert leading_text(pa.table({"messages": msgs.slice(1)}), "messages").to_pylist() == [b"\x00yo", b"\x00"]
    as_json = pa.table({"messages": ['[{"role": "user", "content": "x"}]']})
    assert leading_text(as_json, "messages").to_pylist() == [b'\x00[{"role": "user", "content": "x"}]']
    bad = pa.array([b"ok \xff\xfe text"], pa.binary()).view(pa.string())  # not UTF-8: sorts as bytes, no error
    assert leading_text(pa.table({"prompt": bad}), "prompt").to_pylist() == [b"\x00ok \xff\xfe text"]


def test_auto_stages_only_inputs_whose_rows_share_a_prefix(tmp_path):
    from batchgen.data.order import resolve
    from batchgen.data.reader import PromptDataset

    shared = write(tmp_path / "shared.parquet", prefix_rows(200))
    mode, why = resolve(PromptDataset([str(shared)]), "auto")
    assert mode == "prefix" and "100% of the first 200 rows" in why
    rng = random.Random(1)
    unique = [{"prompt": " ".join(str(rng.random()) for _ in range(40))} for _ in range(200)]
    assert resolve(PromptDataset([str(write(tmp_path / "unique.parquet", unique))]), "auto")[0] == "order"
    short = [{"prompt": "same short prompt"} for _ in range(200)]  # shared, but under four KV blocks
    assert resolve(PromptDataset([str(write(tmp_path / "short.parquet", short))]), "auto")[0] == "order"
    assert resolve(PromptDataset([str(shared)]), "order") == ("order", "asked for")


@pytest.mark.parametrize("with_ids", [True, False])
def test_prefix_shards_are_balanced_grouped_stable_and_hold_every_row_once(tmp_path, monkeypatch, with_ids):
    from batchgen.data import order
    from batchgen.data.fs import Store
    from batchgen.data.reader import PromptDataset

    monkeypatch.setattr(order, "PARTITION_ROWS", 60)  # several partitions (of 50 rows: whole shards) in the pass
    rows = prefix_rows(503, ids=with_ids)
    ds = PromptDataset([str(write(tmp_path / "in.parquet", rows))])
    staged = order.ensure(ds, Store(tmp_path / "run"), 25, ds.fingerprint())
    by_id = {r.get("id", str(i)): r for i, r in enumerate(rows)}
    shards = list(staged.shards(25))
    assert [s.table.num_rows for s in shards] == [25] * 20 + [3]  # balanced: shard_size rows each
    seen = []
    pairs = set()
    for s in shards:
        assert s.table.equals(staged.read_shard(s.index, 25).table)  # a worker reads the same shard alone
        for r in s.rows():
            assert by_id[r["id"]]["prompt"] == r["prompt"] and by_id[r["id"]]["system"] == r["system"]
            seen.append(r["id"])
            pairs.add((s.index, r["system"]))
    assert sorted(seen) == sorted(by_id)  # every row once
    # sorted order: the fewest (shard, prefix) meetings a cut into 21 shards allows (8 prefixes)
    assert len(pairs) <= 21 + 8 - 1
    as_given = {(i // 25, r["system"]) for i, r in enumerate(rows)}
    assert len(as_given) > 100  # in input order, every shard meets nearly every prefix
    plan = json.loads((tmp_path / "run/_plan/plan.json").read_text())
    again = order.stage(ds, Store(tmp_path / "again"), 25, ds.fingerprint())
    assert again["sha256"] == plan["sha256"] and plan["rows"] == 503  # the same input stages the same file


def test_a_prefix_ordered_run_computes_fewer_prompt_tokens_for_the_same_outputs(tmp_path, tiny_model_dir):
    from batchgen.config import EngineConfig, RunConfig, SamplingParams
    from batchgen.report.queries import connect, run_query
    from batchgen.runner import generate

    inp = write(tmp_path / "in.parquet", prefix_rows(48, k=4))
    got = {}
    for shard_by in ("order", "auto"):
        cfg = RunConfig(inputs=(str(inp),), output_dir=str(tmp_path / "runs"), run_id=shard_by, model=str(tiny_model_dir),
                        shard_size=12, shard_by=shard_by, progress=False,
                        sampling=SamplingParams(max_tokens=3, ignore_eos=True),
                        engine_config=EngineConfig(max_num_seqs=4, max_model_len=512, admission="fifo",
                                                   kv_cache_tokens=1024))
        summary = generate(cfg, probe=False)
        (kv,) = run_query(connect([summary.run_dir]), "kv_cache").to_pylist()
        req = read_run_table(summary.run_dir, "requests").to_pylist()
        got[shard_by] = ({r["id"]: r["output_token_ids"] for r in req}, kv["prefill_tokens_computed"],
                         json.loads((tmp_path / "runs" / shard_by / "run.json").read_text()))
    assert got["order"][0] == got["auto"][0] and len(got["auto"][0]) == 48  # the same rows, the same tokens
    assert got["auto"][2]["identity"]["shard_by"] == "prefix" and got["order"][2]["identity"]["shard_by"] == "order"
    assert got["auto"][1] < 0.6 * got["order"][1], (got["auto"][1], got["order"][1])


def test_a_killed_prefix_run_resumes_on_its_staged_order_even_when_damaged(tmp_path, tiny_model_dir):
    inp = write(tmp_path / "in.parquet", prefix_rows(20, k=3))
    out = tmp_path / "runs"
    args = cli_args(inp, out, tiny_model_dir, "r", "--shard-by", "prefix", "--max-model-len", "512")
    killed = run_cli_subprocess(args, kill_at="shard-done:2")
    assert killed.returncode == -9, killed.stderr
    plan = json.loads((out / "r/_plan/plan.json").read_text())
    assert len(list((out / "r/_manifests").iterdir())) == 2
    (out / "r/_plan/rows.parquet").write_bytes(b"not parquet")  # damaged: staged again, to the same file
    done = run_cli_subprocess(args)
    assert done.returncode == 0, done.stderr
    assert "in prefix order (asked for)" in done.stderr
    assert json.loads((out / "r/_plan/plan.json").read_text())["sha256"] == plan["sha256"]
    ids = sorted(read_run_table(out / "r", "requests").column("id").to_pylist())
    assert ids == [f"r{i:04d}" for i in range(20)]  # each row once, the resumed shards too
    refused = run_cli_subprocess(cli_args(inp, out, tiny_model_dir, "r", "--shard-by", "order",
                                          "--max-model-len", "512"))
    assert refused.returncode != 0 and "shard order (--shard-by)" in refused.stderr


def test_auto_resumes_in_the_order_the_run_was_started_in(tmp_path, tiny_model_dir):
    """A run started in input order (or before --shard-by existed: no shard_by in its identity) resumes in
    that order under `auto`, even where auto would now choose prefix order for the input."""
    from batchgen.cli import main

    inp = write(tmp_path / "in.parquet", prefix_rows(8, k=2))
    out = tmp_path / "runs"
    assert main(cli_args(inp, out, tiny_model_dir, "old", "--shard-by", "order", "--max-model-len", "512")) == 0
    doc = json.loads((out / "old/run.json").read_text())
    del doc["identity"]["shard_by"]  # as a run of the previous version recorded it
    (out / "old/run.json").write_text(json.dumps(doc))
    (out / "old/_SUCCESS").unlink()
    resumed = run_cli_subprocess(cli_args(inp, out, tiny_model_dir, "old", "--max-model-len", "512"))
    assert resumed.returncode == 0, resumed.stderr
    assert "(resuming)" in resumed.stderr and "in input order (auto: as the run was started)" in resumed.stderr
    assert not (out / "old/_plan").exists()
