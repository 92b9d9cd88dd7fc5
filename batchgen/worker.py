"""A process's worker: the engine it keeps loaded across shards and runs, the attempt it records into
per run, and the plan a run's first attempt took. The CLI makes one per run; a Prefect or Ray worker
process keeps one for its lifetime (flows/generate.py)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

from batchgen.config import RunConfig
from batchgen.data.reuse import ReuseIndex
from batchgen.data.run_dir import RunDir
from batchgen.engine import Engine, create_engine
from batchgen.engine.plan import EnginePlan
from batchgen.engine.resolve import plan_engine
from batchgen.faults import Faults
from batchgen.metrics.conditions import hardware, software


def say(msg: str) -> None:
    """One line to the user on stderr, as the run goes."""
    print(f"batchgen: {msg}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=4)
def _probe(device: str) -> dict[str, float]:
    from batchgen.metrics.probe import cached_probe

    return cached_probe(device)


class Worker:
    """What one process keeps across shards and runs: its loaded engine (one model on the device at a
    time, reused while the configuration is the same), the attempt it records into for each run, and
    the fault injection its parts are given (none unless the tests' environment asks). The CLI makes
    one per run; a Prefect or Ray worker process keeps one for its lifetime (flows/generate.py)."""

    def __init__(self, faults: Faults | None = None, create: Callable[..., Engine] = create_engine):
        """`create`: how an engine is made (batchgen.engine.create_engine; a test wraps it in a double)."""
        self.faults = faults if faults is not None else Faults.from_env()
        self.create = create
        self.engine: Engine | None = None
        self._engine_key: tuple | None = None
        self.attempts: dict[str, str | None] = {}  # run path -> this process's attempt file in it
        self._reuse: tuple[tuple, ReuseIndex] | None = None  # the index of the run's --reuse-from runs
        self.started: dict[str, EnginePlan | None] = {}  # run path -> the plan its first attempt recorded

    def reuse_index(self, cfg: RunConfig, run_path: str) -> ReuseIndex | None:
        """The request keys of the run's --reuse-from runs (built once per run in this process), or None."""
        if not cfg.reuse_from:
            return None
        key = (str(run_path), cfg.reuse_from)
        if self._reuse is None or self._reuse[0] != key:
            self.close_reuse()
            index = ReuseIndex(list(cfg.reuse_from), exclude=str(run_path))
            for why in index.untrusted:
                say(f"--reuse-from: not trusted, so not reused: {why}")
            self._reuse = (key, index)
        return self._reuse[1]

    def close_reuse(self) -> None:
        if self._reuse is not None:
            self._reuse[1].close()
            self._reuse = None

    def load_engine(self, cfg: RunConfig, model_dir: Path, run: RunDir | None = None) -> Engine:
        """The engine for `cfg`, loaded by its plan (batchgen.engine.resolve.plan_engine). In `run`, the
        plan its first attempt recorded pins `--dtype auto` to the weights it took (read once per run in
        this process). A plan that is not batch-invariant under `--batch-invariant auto` says so here,
        before the engine loads."""
        started = None
        if run is not None:
            if str(run.path) not in self.started:
                self.started[str(run.path)] = plan_as_started(run)
            started = self.started[str(run.path)]
        key = (cfg.engine, str(model_dir), cfg.engine_config,
               json.dumps(cfg.engine_options, sort_keys=True, default=str), cfg.lora_adapters, started)
        if self.engine is None or key != self._engine_key:
            if self.engine is not None:
                self.drop_engine(self.engine)  # one model on the device at a time
            plan = plan_engine(cfg.engine, model_dir, cfg.engine_config, dict(cfg.engine_options), started)
            if not plan.batch_invariant and cfg.engine_config.batch_invariant == "auto":
                say(f"not batch-invariant: {plan.why['batch_invariant']}. A row's tokens may depend on the rows "
                    f"beside it and on max_num_seqs, and no request keys are written (--reuse-from cannot copy "
                    f"these rows); --batch-invariant on refuses such a run")
            self.engine = self.create(cfg.engine, model_dir, cfg.engine_config, options=dict(cfg.engine_options),
                                      lora_adapters=dict(cfg.lora_adapters), faults=self.faults, plan=plan)
            self._engine_key = key
        return self.engine

    def drop_engine(self, engine: Engine) -> None:
        """Forget (and close) an engine that failed, so that a retry in this process starts a fresh one."""
        if engine is self.engine:
            self.engine, self._engine_key = None, None
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - it is already broken; closing is best effort
            pass

    def record_once(self, run: RunDir, cfg: RunConfig, engine: Engine, probe: bool = True) -> None:
        """This process's attempt in the run, recorded once: a worker opens the run afresh for each
        shard and keeps writing to its one attempt."""
        if str(run.path) not in self.attempts:
            run.record_attempt(run_conditions(cfg, engine, probe))
            self.attempts[str(run.path)] = run.attempt_file
        else:
            run.attempt_file = self.attempts[str(run.path)]


def plan_as_started(run: RunDir) -> EnginePlan | None:
    """The plan the run's first attempt recorded (its engine conditions' `plan`), or None: a fresh run,
    or one recorded before plans were."""
    first = next((a["conditions"]["engine"] for a in run.attempts() if "engine" in a.get("conditions", {})), None)
    return EnginePlan.from_fields(first["plan"]) if first and "plan" in first else None


def run_conditions(cfg: RunConfig, engine: Engine, probe: bool = True) -> dict[str, Any]:
    hw = hardware(cfg.engine_config.device)
    if probe:
        hw.update(_probe(cfg.engine_config.device))
    return {"engine": engine.conditions(), "hardware": hw, "software": software()}
