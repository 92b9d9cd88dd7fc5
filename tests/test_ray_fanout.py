"""Shard tasks fan out over a real local Ray cluster (two CPU worker nodes) through prefect-ray."""

import os

import pytest

from conftest import read_run_table, upload, write_prompts

pytestmark = pytest.mark.heavy  # starts vLLM, a Prefect server or a Ray cluster: not in `make test-fast`


@pytest.fixture(scope="module")
def ray_cluster(s3_server):
    """Started after the S3 server, so the worker processes inherit the endpoint and credentials."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the head runs no shard
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    import ray

    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(autouse=True)
def _harness(prefect_harness):
    """Every test here runs against the session's Prefect test harness."""


def outputs(run_dir):
    req = read_run_table(run_dir, "requests").to_pylist()
    err = read_run_table(run_dir, "errors").to_pylist()
    return {r["id"]: r["output_token_ids"] for r in req}, sorted(e["id"] for e in err)


def test_shards_land_on_both_workers_with_the_local_result(tmp_path, tiny_model_dir, ray_cluster):
    from batchgen.settings import GenerateSettings
    from flows.generate import FanOut, generate

    inp = write_prompts(tmp_path / "in.parquet", [f"tell me about {i}" for i in range(11)] + [""],
                        ids=[f"r{i:02d}" for i in range(12)])
    base = dict(input=[str(inp)], output=str(tmp_path / "runs"), model=str(tiny_model_dir), max_tokens=4,
                max_model_len=64, max_num_seqs=2, shard_size=2)
    on_ray = generate(GenerateSettings(**base, run_id="ray"), FanOut(ray_address=ray_cluster.address))
    local = generate(GenerateSettings(**base, run_id="local"))
    assert on_ray["shards"] == 6 and on_ray["rows"] == 12
    ray_workers = [w for w in on_ray["workers"] if w.startswith("ray-node-")]
    assert len(ray_workers) == 2, on_ray["workers"]  # both worker nodes committed shards
    assert outputs(on_ray["run_dir"]) == outputs(local["run_dir"])  # the same exactly-once result
    assert outputs(on_ray["run_dir"])[1] == ["r11"]


def test_two_ray_workers_write_the_shards_of_one_run_to_the_same_bucket(tmp_path, tiny_model_dir, ray_cluster,
                                                                         bucket):
    """Workers on different nodes share no disk: the input and the run live in the bucket."""
    from batchgen.data.fs import Store
    from batchgen.settings import GenerateSettings
    from flows.generate import FanOut, generate

    inp = write_prompts(tmp_path / "in.parquet", [f"tell me about {i}" for i in range(11)] + [""],
                        ids=[f"r{i:02d}" for i in range(12)])
    upload(inp, f"{bucket}/in/prompts.parquet")
    base = dict(model=str(tiny_model_dir), max_tokens=4, max_model_len=64, max_num_seqs=2, shard_size=2)
    on_ray = generate(GenerateSettings(**base, input=[f"{bucket}/in/"], output=f"{bucket}/runs", run_id="ray"),
                      FanOut(ray_address=ray_cluster.address))
    local = generate(GenerateSettings(**base, input=[str(inp)], output=str(tmp_path / "runs"), run_id="local"))
    assert on_ray["run_dir"] == f"{bucket}/runs/ray" and on_ray["shards"] == 6
    assert len([w for w in on_ray["workers"] if w.startswith("ray-node-")]) == 2, on_ray["workers"]
    assert outputs(on_ray["run_dir"]) == outputs(local["run_dir"])
    assert Store(on_ray["run_dir"]).exists("_SUCCESS")


def test_a_prefix_ordered_run_goes_out_in_lanes_of_adjacent_shards(tmp_path, tiny_model_dir, ray_cluster):
    """Shards that share a prefix are adjacent in prefix order; each lane (one per Ray worker here) takes a
    contiguous run of them in one process, whose prefix cache carries over."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.settings import GenerateSettings
    from flows.generate import FanOut, generate

    rng = random.Random(0)
    sys_ = [f"You are helper {j}. " + " ".join(f"rule{j}-{w}" for w in range(60)) for j in range(2)]
    rows = [{"id": f"r{i:02d}", "system": sys_[rng.randrange(2)], "prompt": f"question {i}"} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    base = dict(input=[str(tmp_path / "in.parquet")], output=str(tmp_path / "runs"), model=str(tiny_model_dir),
                max_tokens=3, max_model_len=512, max_num_seqs=2, shard_size=2)
    on_ray = generate(GenerateSettings(**base, run_id="ray-prefix"), FanOut(ray_address=ray_cluster.address))
    local = generate(GenerateSettings(**base, run_id="local-order", shard_by="order"))
    assert on_ray["shard_by"] == "prefix" and local["shard_by"] == "order"
    lanes = on_ray["shard_workers"]  # two lanes of four adjacent shards, one per worker node
    assert lanes[:4] == [lanes[0]] * 4 and lanes[4:] == [lanes[4]] * 4 and lanes[0] != lanes[4], lanes
    assert outputs(on_ray["run_dir"]) == outputs(local["run_dir"])
