"""Prefect flow: generate a Parquet prompt dataset, one task per shard, in process or on Ray."""

from __future__ import annotations

import collections
import functools
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, Field

from batchgen import budget
from batchgen.data.order import lane_split
from batchgen.outcome import check_error_rate
from batchgen.runner import abandon, finalize, open_run, run_shard_in_worker
from batchgen.worker import Worker
from batchgen.settings import GenerateSettings


ROWS_KEY = "batchgen-rows"  # the artifact that says what a run did with its rows


class FanOut(BaseModel):
    """Where shard tasks run: in this process (default) or on a Ray cluster."""

    ray_address: str | None = Field(None, title="Ray address",
                                    description="'auto', 'ray://head:10001' or empty for in-process")
    gpus_per_shard: float = Field(0.0, ge=0, title="GPUs per shard task (Ray)",
                                  description="1 on GPU workers: Ray then pins one GPU to each shard task")
    lanes: int = Field(0, ge=0, title="Lanes for a prefix-ordered run (Ray)",
                       description="its shards go out as this many tasks, each a contiguous run of shards done in "
                                   "one worker process, so that process's prefix cache carries over between shards "
                                   "that share a prefix; 0: as many as the cluster runs at once (its GPUs / GPUs "
                                   "per shard, or its CPUs)")


@functools.cache
def process_worker() -> Worker:
    """This process's worker: the engine it keeps loaded across shard tasks (and flow runs), the
    attempt it records into per run, its fault injection. The library holds no process state; a task,
    in a thread of the flow's process or in a Ray worker process, finds its process's one worker here
    (made on first use in that process; a task shipped to Ray carries a reference to this function,
    never a loaded engine)."""
    return Worker()


def _retry_unless_over_budget(task, task_run, state) -> bool:
    """A shard task is retried, except past the run's budget (--max-hours, --max-cost): that stops the run."""
    try:
        state.result()
    except budget.BudgetReached:
        return False
    except Exception:  # noqa: BLE001 - any other failure is worth a retry
        return True
    return True


@task(retries=2, retry_delay_seconds=10, retry_condition_fn=_retry_unless_over_budget, task_run_name="shard-{index}")
def generate_shard(settings: GenerateSettings, run_path: str, index: int,
                   deadline: float | None = None) -> dict[str, Any]:
    """Generate and commit one shard (a committed shard is skipped, a partial one redone)."""
    manifest = run_shard_in_worker(settings.to_run_config(), run_path, index, process_worker(), deadline)
    return {**manifest, "worker": _worker_name()}


@task(retries=2, retry_delay_seconds=10, retry_condition_fn=_retry_unless_over_budget, task_run_name="lane-{lane}")
def generate_lane(settings: GenerateSettings, run_path: str, lane: int, indices: list[int],
                  deadline: float | None = None) -> list[dict[str, Any]]:
    """Generate a contiguous run of shards of a prefix-ordered run, in order, in this one process: rows
    that share a prefix sit in adjacent shards, and the engine's prefix cache carries over between them.
    A retry skips the shards already committed."""
    logger = get_run_logger()
    manifests = []
    for index in indices:
        manifest = run_shard_in_worker(settings.to_run_config(), run_path, index, process_worker(), deadline)
        manifests.append({**manifest, "worker": _worker_name()})
        logger.info("lane %s: shard %s %s", lane, index, "was already committed" if manifest.get("skipped")
                    else "committed")
    return manifests


def _ray_slots(gpus_per_shard: float) -> int:
    """How many shard tasks the connected Ray cluster runs at once."""
    import ray

    resources = ray.cluster_resources()
    if gpus_per_shard:
        return int(resources.get("GPU", 0) // gpus_per_shard) or 1
    return int(resources.get("CPU", 1)) or 1


def _worker_name() -> str:
    """The Ray node that ran the task, or this host and process."""
    import os
    import socket
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return f"ray-node-{ray.get_runtime_context().get_node_id()[:12]}"
    return f"{socket.gethostname()}-{os.getpid()}"


def _task_runner(fanout: FanOut):
    if not fanout.ray_address:
        return ThreadPoolTaskRunner(max_workers=1)  # one engine, one device: shards in sequence
    from prefect_ray import RayTaskRunner

    return RayTaskRunner(address=fanout.ray_address)


@flow(name="batchgen-generate-shards")
def generate_shards(settings: GenerateSettings, run_path: str, indices: list[int],
                    gpus_per_shard: float = 0.0, lanes: int | None = None,
                    deadline: float | None = None) -> list[dict[str, Any]]:
    """Fan the shards out over the flow's task runner and report progress as they commit: one task per
    shard, or (`lanes`, a prefix-ordered run on Ray; 0 for as many as the cluster runs at once) one task
    per contiguous run of shards."""
    logger = get_run_logger()
    progress = create_progress_artifact(0.0, description=f"shards committed of run {run_path}")
    if lanes is not None:
        work = [(generate_lane, (settings, run_path, k, run, deadline))
                for k, run in enumerate(lane_split(indices, lanes or _ray_slots(gpus_per_shard)))]
    else:
        work = [(generate_shard, (settings, run_path, index, deadline)) for index in indices]
    futures = []
    for fn, args in work:
        if gpus_per_shard:
            from prefect_ray.context import remote_options

            with remote_options(num_gpus=gpus_per_shard):
                futures.append(fn.submit(*args))
        else:
            futures.append(fn.submit(*args))
    manifests = []
    cfg, rows, errors, reasons = settings.to_run_config(), 0, 0, collections.Counter()
    for future in as_completed(futures):
        result = future.result()
        for m in result if isinstance(result, list) else [result]:
            manifests.append(m)
            if m.get("skipped"):
                logger.info("shard %s was already committed", m["shard"])
            else:
                logger.info("shard %s committed: %s rows, %s outputs, %s errors, %s tokens", m["shard"], m["rows"],
                            m["ok"], m["errors"], m["output_tokens"])
                rows, errors = rows + m["rows"], errors + m["errors"]
                reasons.update({reason: n for reason, n in m.get("error_reasons", [])})
                check_error_rate(cfg, rows, errors, reasons)  # --max-error-rate: the flow fails with its line
        update_progress_artifact(progress, 100.0 * len(manifests) / max(len(indices), 1))
    return manifests


@flow(name="batchgen-generate")
def generate(settings: GenerateSettings, fanout: FanOut = FanOut()) -> dict[str, Any]:
    """Generate outputs and per-token timings for a prompt dataset; re-running a run id resumes it.

    Args:
        settings: the generation job: input, model, engine, sampling, batching and output
        fanout: where the shard tasks run: in this process, or on a Ray cluster
    """
    logger = get_run_logger()
    if settings.run_id is None:  # a retried flow run must land in the same run directory
        settings = settings.model_copy(update={"run_id": f"flow-{flow_run.get_id()[:8]}"})
    settings = settings.model_copy(update={"progress": False})
    deadline = budget.deadline(settings.to_run_config())  # one instant for every shard task, wherever it runs
    opened = open_run(settings.to_run_config(), process_worker().faults)
    logger.info("run %s: %s rows in %s shards%s, in %s order (%s)", opened.run.path, opened.dataset.num_rows,
                opened.num_shards, " (resuming)" if opened.resumed else "", opened.shard_by, opened.shard_by_why)
    try:
        shards_flow = generate_shards.with_options(task_runner=_task_runner(fanout))
        lanes = fanout.lanes if fanout.ray_address and opened.shard_by == "prefix" else None
        manifests = shards_flow(settings, str(opened.run.path), list(range(opened.num_shards)), fanout.gpus_per_shard,
                                lanes, deadline)
    except BaseException as e:
        abandon(opened, e)
        if isinstance(e, budget.BudgetReached):
            raise budget.BudgetReached(budget.how_far(str(e), opened.run.manifests(), opened.num_shards,
                                                      opened.dataset.num_rows, opened.run.name)) from None
        raise
    summary = finalize(opened)
    logger.info("run %s complete: %s", opened.run.path, summary)
    create_table_artifact([{"run": opened.run.name, "rows": summary["rows"], "generated": summary["ok"] - summary["reused"],
                            "reused": summary["reused"], "errors": summary["errors"], "shards": summary["shards"]}],
                          key=ROWS_KEY, description="rows generated, reused from earlier runs (--reuse-from), errors")
    workers = sorted({m["worker"] for m in manifests})
    shard_workers = {m["shard"]: m["worker"] for m in manifests}
    return {"run_dir": str(opened.run.path), **summary, "workers": workers, "shard_by": opened.shard_by,
            "shard_workers": [shard_workers[i] for i in range(opened.num_shards)]}
