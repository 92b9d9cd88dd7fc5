"""The runner: the one short loop that joins reader, engine and writer, shard by shard.

    open_run (validate input, lock, run.json) -> run_shard for each shard -> finalize (_SUCCESS)

`generate` does all of it in one process (the CLI). A Prefect flow calls `open_run` and `finalize`
itself and fans `generate_shard` (flows/generate.py) out as one task per shard, in process or on Ray workers: each
process's `Worker` (batchgen.worker) keeps its engine loaded across shards, and a per-shard lock stops two
workers doing one shard.
Committed shards are skipped on resume once their files match their manifest's checksums; a partial
or damaged one is cleared and redone. A request that makes the engine fail is isolated and becomes
an error row; SIGTERM/SIGINT end the run cleanly (lease released, attempt recorded as interrupted).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from batchgen import budget
from batchgen.config import RunConfig
from batchgen.data import order
from batchgen.data.fs import join
from batchgen.data.lock import LockError
from batchgen.data.prompts import InputProcessor, PreparedRow, RowError
from batchgen.data.reader import InputError, PromptDataset, Shard
from batchgen.data.reuse import ReuseIndex, find_runs, numerics, request_key
from batchgen.data.run_dir import IDENTITY_DEFAULTS, RunDir, new_run_id
from batchgen.data.writer import SCHEMAS, ShardWriter
from batchgen.engine import Engine, EngineDead, RequestRejected
from batchgen.engine.resolve import can_be_batch_invariant, check_invariance_possible
from batchgen.faults import Faults
from batchgen.metrics.clock import RunClock
from batchgen.metrics.conditions import model_fingerprint, software
from batchgen.model.prepare import resolve_model
from batchgen.outcome import RunSummary, check_error_rate, error_reasons, output_health
from batchgen.signals import Interrupted, interruptible
from batchgen.worker import Worker, say


@dataclass
class OpenRun:
    cfg: RunConfig
    run: RunDir
    dataset: PromptDataset
    model_dir: Path
    resumed: bool
    shard_by: str = "order"  # the order the shards were cut in (--shard-by resolved), and why
    shard_by_why: str = ""

    @property
    def num_shards(self) -> int:
        return self.dataset.num_shards(self.cfg.shard_size)


# Settings that only shape the batches: under batch invariance they cannot change a row's tokens, so a
# resume may change them (resume a crashed run with wider batches on a bigger machine)
BATCH_SHAPE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "kv_cache_memory_fraction",
                        "kv_cache_tokens", "block_size", "enable_prefix_caching", "compile", "cuda_graphs",
                        "admission")


def run_identity(cfg: RunConfig, model_dir: Path, input_fingerprint: str, shard_by: str) -> dict[str, Any]:
    """What must not change under one run id (a resume with other settings is refused). With batch
    invariance on, the settings that only shape batches are left out (BATCH_SHAPE_SETTINGS).
    `shard_by`: the order the shards were cut in ('prefix' or 'order', --shard-by auto resolved)."""
    engine_config = asdict(cfg.engine_config)
    if cfg.engine == "native" and can_be_batch_invariant(cfg.engine, cfg.engine_config):
        for name in BATCH_SHAPE_SETTINGS:
            engine_config.pop(name)
        # auto and on make the same run where it can be batch-invariant (elsewhere on is refused)
        engine_config["batch_invariant"] = "on"
    identity = {"engine": cfg.engine, "model_fingerprint": model_fingerprint(model_dir),
                "engine_config": engine_config, "sampling": cfg.sampling.record(),
                "engine_options": [list(p) for p in cfg.engine_options], "input_fingerprint": input_fingerprint,
                "shard_size": cfg.shard_size, "shard_by": shard_by, "too_long": cfg.too_long,
                "chat_template_kwargs": [list(p) for p in cfg.chat_template_kwargs], "n": cfg.n,
                "lora_adapters": [list(p) for p in cfg.lora_adapters],
                "keep_columns": list(cfg.keep_columns), "prompt_format": cfg.prompt_format}
    return json.loads(json.dumps(identity, default=str))  # compare as it is stored


def open_run(cfg: RunConfig, faults: Faults | None = None) -> OpenRun:
    """Validate the whole input, then create or resume the run directory and take its lock."""
    check_invariance_possible(cfg.engine, cfg.engine_config)  # `--batch-invariant on` where it cannot be
    dataset = PromptDataset(cfg.inputs, cfg.keep_columns)  # whole-input errors stop us here, before any work
    clash = sorted(set(cfg.keep_columns) & set(SCHEMAS["requests"].names + SCHEMAS["errors"].names))
    if clash:
        raise InputError(f"--keep-columns {', '.join(clash)}: an output column has that name; keep the others, "
                         f"or rename the input column")
    if cfg.engine == "vllm":
        from batchgen.engine.vllm import check_vllm_options

        check_vllm_options(dict(cfg.engine_options))
    run = RunDir(join(cfg.output_dir, cfg.run_id or new_run_id()), faults)
    model_dir = resolve_model(cfg.model)
    started = run.read_json().get("identity", {}) if run.store.exists("run.json") else None
    if cfg.shard_by == "auto" and started is not None:  # a resume keeps the order its shards were cut in
        shard_by, why = started.get("shard_by", IDENTITY_DEFAULTS["shard_by"]), "auto: as the run was started"
    else:
        shard_by, why = order.resolve(dataset, cfg.shard_by)
    fingerprint = dataset.fingerprint()
    identity = run_identity(cfg, model_dir, fingerprint, shard_by)
    info = {"input": {"files": dataset.files, "rows": dataset.num_rows, "shards": dataset.num_shards(cfg.shard_size),
                      "shard_by": shard_by, "shard_by_why": why},
            "model": str(model_dir), "software": software()}
    if cfg.reuse_from:  # a location without a run is refused now, before any work
        info["reuse_from"] = {"locations": list(cfg.reuse_from), "runs": find_runs(list(cfg.reuse_from),
                                                                                   exclude=str(run.path))}
    resumed = run.open(identity, info)
    if shard_by == "prefix":
        try:
            dataset = order.ensure(dataset, run.store, cfg.shard_size, fingerprint)
        except BaseException:
            run.unlock()
            raise
    return OpenRun(cfg, run, dataset, model_dir, resumed, shard_by, why)


def run_shard(cfg: RunConfig, run: RunDir, dataset: PromptDataset, engine: Engine, index: int,
              progress: "_Progress | None" = None, shard: Shard | None = None,
              reuse: ReuseIndex | None = None, deadline: float | None = None) -> dict[str, Any] | None:
    """Generate one shard and commit it; None if it was already committed (and its files check out).
    `shard` is given when the caller streams the dataset; otherwise the shard's rows are read alone.
    `reuse`: earlier runs' rows, copied where their request key is the same (batchgen.data.reuse).
    `deadline`: the run's budget (batchgen.budget), past which the shard stops uncommitted."""
    budget.check(deadline, cfg)
    with run.shard_lock(index) as lease:
        committed, problem = run.check_shard(index)
        if committed:
            return None
        if problem:
            say(f"shard {index} was committed but {problem}; redoing the shard")
        run.clear_shard(index)
        shard = shard or dataset.read_shard(index, cfg.shard_size)
        doc = run.read_json()
        engine.clock = RunClock(doc["run_start_wall"])
        # what decides a row's tokens on this engine, or None where it is not batch-invariant (no keys)
        numerics_ = numerics(doc["identity"]["model_fingerprint"], engine.conditions(), engine.max_model_len)
        processor = InputProcessor.for_run(cfg, engine.tokenizer, engine.max_model_len)
        writer = ShardWriter(pa.schema([dataset.schema.field(c) for c in cfg.keep_columns]))
        prepared, prompt_of = [], {}
        for row in shard.rows():
            writer.keep(row)
            p = processor.process(row)
            if isinstance(p, RowError):
                writer.add_error(p)
            else:
                prompt_of[p.id] = hash(tuple(p.prompt_token_ids))  # the row's prompt, for output_health
                for k, sample in enumerate(p.samples()):  # n samples: n requests, mapped back by the writer
                    key = request_key(numerics_, sample.prompt_token_ids, sample.sampling, k) if numerics_ else None
                    prepared.append((sample, key))
                    writer.expect(sample.id, p.id, k, p.n, sample.sampling.seed, p.truncated_from, key)
        prepared = _reuse_rows(prepared, reuse, writer)
        if progress:
            progress.update(len(writer.errors["id"]) + writer.num_reused)
        _generate_isolating_failures(engine, writer, prepared, progress, run.faults, deadline, cfg)
        tables = writer.tables()
        manifest = run.commit_shard(index, tables, shard.table.column("id").combine_chunks(),
                                    {"output_tokens": writer.num_output_tokens, "reused": writer.num_reused,
                                     **output_health(tables["requests"], prompt_of),
                                     "error_reasons": error_reasons(tables["errors"])}, fence=lease)
        run.refresh_attempt(engine.conditions())  # compile seconds grow as buckets are first used
        run.faults.checkpoint("shard-done")
        return manifest


def _reuse_rows(prepared: list[tuple[PreparedRow, str | None]], reuse: ReuseIndex | None,
                writer: ShardWriter) -> list[PreparedRow]:
    """Copy the requests an earlier run answered under the same key; return the ones left to generate.
    A request that asks for logprobs is generated (they live in the earlier run's tokens/, not copied)."""
    lookup = [key for p, key in prepared if key is not None and p.sampling.logprobs is None]
    found = reuse.lookup(lookup) if reuse is not None and lookup else {}
    left = []
    for p, key in prepared:
        if key in found and p.sampling.logprobs is None:
            writer.add_reused(p.id, found[key])
        else:
            left.append(p)
    return left


def _generate_isolating_failures(engine: Engine, writer: ShardWriter, rows: list[PreparedRow],
                                 progress: "_Progress | None", faults: Faults, deadline: float | None = None,
                                 cfg: RunConfig | None = None) -> None:
    """Feed `rows` to the engine and step it until they are done. If a step fails (and the engine is
    not dead), the unfinished requests are aborted and redone in halves, so a request that breaks
    the engine ends alone, as an error row, while the rest of the shard completes. Redone requests
    give the same tokens: greedy is deterministic and sampling noise depends on (seed, index) only."""
    failures: list[tuple[str, str]] = []
    queue = [rows]
    while queue:
        group = queue.pop()
        by_id = {}
        for p in group:
            try:
                engine.add(p.id, p.prompt_token_ids, p.sampling)
                by_id[p.id] = p
            except RequestRejected as e:
                writer.add_error(RowError(p.id, str(e), "engine"))
        try:
            while engine.has_unfinished():
                result = engine.step()
                writer.add_step(result)
                if progress:
                    progress.update(len(result.finished), len(result.token_request_ids))
                faults.checkpoint("step")
                budget.check(deadline, cfg)
        except (EngineDead, budget.BudgetReached):
            raise
        except Exception as e:  # noqa: BLE001 - maybe one request's fault: find it by halving
            unfinished = engine.abort_all()
            writer.discard(unfinished)
            left = [by_id[i] for i in unfinished if i in by_id]
            if len(left) == 1:
                failures.append((left[0].id, f"the engine failed on this request: {type(e).__name__}: {e}"))
            elif left:
                say(f"an engine step failed ({type(e).__name__}: {e}); isolating the request among {len(left)}")
                queue += [left[: len(left) // 2], left[len(left) // 2:]]
    if len(failures) > 1 and len(failures) == len(rows):  # not a bad request: a broken engine
        raise RuntimeError(f"the engine failed on every request of the shard alone; last: {failures[-1][1]}")
    for rid, reason in failures:
        writer.add_error(RowError(rid, reason, "engine"))


def run_shard_in_worker(cfg: RunConfig, run_path: str, index: int, worker: Worker,
                        deadline: float | None = None) -> dict[str, Any]:
    """A shard as a unit of distributed work: everything from the config and the run directory, on
    the process's worker (its loaded engine). `deadline`: the run's budget (batchgen.budget)."""
    budget.check(deadline, cfg)
    run = RunDir(run_path, worker.faults)
    model_dir = resolve_model(cfg.model)
    engine = worker.load_engine(cfg, model_dir, run)
    worker.record_once(run, cfg, engine)
    try:
        dataset = order.planned(PromptDataset(cfg.inputs, cfg.keep_columns), run.store,
                                run.read_json()["identity"].get("shard_by", IDENTITY_DEFAULTS["shard_by"]))
        manifest = run_shard(cfg, run, dataset, engine, index,
                             reuse=worker.reuse_index(cfg, run_path), deadline=deadline)
    except BaseException:
        worker.drop_engine(engine)  # its state is unknown (a dead vLLM core, half-fed requests): start clean
        raise
    return manifest or {"shard": index, "skipped": True}


def finalize(opened: OpenRun) -> dict[str, int]:
    """Verify that the input's ids and the outputs' are the same set, each once; record the attempt
    as completed, write _SUCCESS and release the run's lease."""
    try:
        summary = opened.run.verify(opened.dataset.ids(), opened.num_shards)
        if opened.cfg.output_format == "openai-batch":
            write_openai_files(opened)
        opened.run.end_attempt("completed")
        opened.run.mark_success(summary)
        return summary
    finally:
        opened.run.unlock()


def write_openai_files(opened: OpenRun) -> None:
    """batch_output.jsonl and batch_errors.jsonl beside the Parquet tables (which stay the record),
    line for line as the OpenAI Batch API writes its output and error files."""
    from batchgen.data.formats import write_openai_batch

    run = opened.run
    out, err = write_openai_batch(run.read_table("requests"), run.read_table("errors"), opened.cfg.model,
                                  chat=opened.dataset.prompt_column == "messages",
                                  order=opened.dataset.ids().to_pylist())
    run.store.write("batch_output.jsonl", out)
    run.store.write("batch_errors.jsonl", err)


def abandon(opened: OpenRun, exc: BaseException) -> None:
    """End an attempt that did not finish: record why in run.json, release the lease."""
    if isinstance(exc, (KeyboardInterrupt, Interrupted)):
        status, detail = "interrupted", str(exc) or "interrupted (SIGINT)"
    elif isinstance(exc, budget.BudgetReached):
        status, detail = "stopped", str(exc)
    else:
        status, detail = "failed", f"{type(exc).__name__}: {exc}"
    try:
        opened.run.end_attempt(status, detail)
    finally:
        opened.run.unlock()


def generate(cfg: RunConfig, on_shard: Callable[[dict], None] | None = None, probe: bool = True,
             on_start: Callable[[OpenRun], None] | None = None, worker: Worker | None = None) -> RunSummary:
    """Run (or resume) one generation job in this process; `worker`: one kept across runs (its
    engine stays loaded), else a new one for this run."""
    t_start = time.perf_counter()
    own_worker = worker is None
    worker = worker or Worker()
    deadline = budget.deadline(cfg)  # from this invocation's start: loading the model is paid for too
    with interruptible():
        opened = open_run(cfg, worker.faults)
        if on_start:
            on_start(opened)
        output_tokens = generated = empty = most_common = looped = rows_done = errors_done = 0
        reasons: collections.Counter[str] = collections.Counter()
        engine = None
        try:
            engine = worker.load_engine(cfg, opened.model_dir, opened.run)
            worker.attempts.pop(str(opened.run.path), None)  # a new attempt, even in a kept worker
            worker.record_once(opened.run, cfg, engine, probe)
            progress = _Progress(cfg.progress, opened.dataset.num_rows, opened.run.name)
            reuse = worker.reuse_index(cfg, str(opened.run.path))
            for shard in opened.dataset.shards(cfg.shard_size):  # one streaming pass over the input
                manifest = run_shard(cfg, opened.run, opened.dataset, engine, shard.index, progress, shard, reuse,
                                     deadline)
                if manifest is None:
                    progress.update(shard.table.num_rows)
                    continue
                output_tokens += manifest["output_tokens"]
                generated += manifest["ok"]
                empty += manifest.get("empty_outputs", 0)
                most_common = max(most_common, manifest.get("most_common_output", 0))
                looped += manifest.get("looped_outputs", 0)
                rows_done, errors_done = rows_done + manifest["rows"], errors_done + manifest["errors"]
                reasons.update({reason: n for reason, n in manifest.get("error_reasons", [])})
                check_error_rate(cfg, rows_done, errors_done, reasons)
                if on_shard:
                    on_shard(manifest)
            progress.close()
            summary = finalize(opened)
        except BaseException as e:
            lost = opened.run.lease_lost(e)
            if engine is not None:
                worker.drop_engine(engine)
            abandon(opened, e)
            if lost:
                raise LockError(lost) from e
            if isinstance(e, budget.BudgetReached):
                raise budget.BudgetReached(budget.how_far(str(e), opened.run.manifests(), opened.num_shards,
                                                          opened.dataset.num_rows, opened.run.name)) from None
            raise
        finally:
            worker.close_reuse()
        if own_worker:  # nobody will reuse it: give the device back now
            worker.drop_engine(engine)
    return RunSummary(str(opened.run.path), summary["rows"], summary["ok"], summary["errors"], summary["shards"],
                      opened.resumed, output_tokens, time.perf_counter() - t_start, summary["reused"], generated,
                      empty, most_common, cfg.output_format, looped)


class _Progress:
    """tqdm over requests done, with output tok/s as postfix (quiet when disabled)."""

    def __init__(self, enabled: bool, total: int, run_id: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", desc=run_id, file=sys.stderr, dynamic_ncols=True)
        self.n_tokens = 0
        self.t0 = time.perf_counter()

    def update(self, requests: int, tokens: int = 0) -> None:
        self.n_tokens += tokens
        if self.bar:
            if tokens:
                rate = self.n_tokens / max(time.perf_counter() - self.t0, 1e-9)
                self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
            self.bar.update(requests)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
