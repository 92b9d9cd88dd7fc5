"""A process's worker: the engine it keeps loaded across shards and runs, the attempt it records into
per run, and the weights a run's first attempt took. The CLI makes one per run; a Prefect or Ray worker
process keeps one for its lifetime (flows/generate.py)."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from batchgen.config import RunConfig
from batchgen.data.reuse import ReuseIndex
from batchgen.data.run import RunDir
from batchgen.engine import Engine, create_engine
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
        self.pinned: dict[str, RunConfig] = {}  # run path -> its config with the weights it started with

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
        """The engine for `cfg`; in `run`, with the weights its first attempt took (weights_as_started,
        read once per run in this process: a worker's later shards keep what its first one took)."""
        if run is not None:
            if str(run.path) not in self.pinned:
                self.pinned[str(run.path)] = weights_as_started(cfg, run)
            cfg = self.pinned[str(run.path)]
        key = (cfg.engine, str(model_dir), cfg.engine_config,
               json.dumps(cfg.engine_options, sort_keys=True, default=str), cfg.lora_adapters)
        if self.engine is None or key != self._engine_key:
            if self.engine is not None:
                self.drop_engine(self.engine)  # one model on the device at a time
            self.engine = self.create(cfg.engine, model_dir, cfg.engine_config, options=dict(cfg.engine_options),
                                        lora_adapters=dict(cfg.lora_adapters), faults=self.faults)
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


def weights_as_started(cfg: RunConfig, run: RunDir) -> RunConfig:
    """`cfg` with `--dtype auto` pinned to the weights the run's first attempt took, where that attempt
    was batch-invariant: auto takes the model's GGUF blocks by max_num_seqs's batch band, and a resume
    may change max_num_seqs (BATCH_SHAPE_SETTINGS) without changing a token."""
    ec = cfg.engine_config
    if cfg.engine != "native" or ec.dtype != "auto" or ec.quantization != "none" or ec.batch_invariant != "on":
        return cfg
    first = next((a["conditions"]["engine"] for a in run.attempts() if "engine" in a.get("conditions", {})), None)
    if first is None or not str(first.get("batch_invariant", "")).startswith("on"):
        return cfg
    gguf = str(first.get("quantization") or "").startswith("gguf")
    pinned = replace(ec, quantization="gguf") if gguf else replace(ec, dtype=first["dtype"])
    took = "the GGUF blocks" if gguf else first["dtype"]
    say(f"--dtype auto: the weights an earlier attempt of this run took: {took}")
    return replace(cfg, engine_config=pinned)


def run_conditions(cfg: RunConfig, engine: Engine, probe: bool = True) -> dict[str, Any]:
    hw = hardware(cfg.engine_config.device)
    if probe:
        hw.update(_probe(cfg.engine_config.device))
    return {"engine": engine.conditions(), "hardware": hw, "software": software()}
