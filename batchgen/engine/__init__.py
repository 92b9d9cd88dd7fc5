"""Engines behind one interface; heavy backends are imported only when asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from batchgen.config import EngineConfig
from batchgen.engine.base import Engine, EngineDead, FinishedRequest, RequestRejected, StepResult


def create_engine(name: str, model_dir: str | Path, config: EngineConfig, clock: Callable[[], float] | None = None,
                  options: dict[str, Any] | None = None, lora_adapters: dict[str, str] | None = None,
                  faults=None, plan=None) -> Engine:
    """`plan` (batchgen.engine.plan.EnginePlan): what the engine runs, resolved by
    batchgen.engine.resolve.plan_engine (the engine makes it from `config` where not given). `faults`
    (batchgen.faults.Faults): requests that break the native engine's step, for the tests."""
    if name == "native":
        from batchgen.engine.native import NativeEngine

        return NativeEngine(model_dir, config, clock, faults=faults, plan=plan)
    if name == "vllm":
        from batchgen.engine.vllm import VllmEngine  # noqa: F401  (imports vllm lazily)

        return VllmEngine(model_dir, config, clock, options or {}, lora_adapters or {}, plan=plan)
    raise ValueError(f"unknown engine {name!r}; choose 'native' or 'vllm'")


__all__ = ["Engine", "EngineDead", "EngineConfig", "FinishedRequest", "RequestRejected", "StepResult", "create_engine"]
