"""A run's budget: `--max-hours` and `--max-cost` (at `--price-per-hour`), as one wall-clock deadline.

The deadline is fixed when the run (this invocation, or the flow run) starts, as seconds since the
epoch, so a shard task on another process or machine checks the same instant. Past it, the engine's
step loop stops: the shard in progress is not committed (it is redone on resume, as after a crash),
committed shards stay, and the run ends with one line saying how far it got and how to go on.
"""

from __future__ import annotations

import time

from batchgen.config import RunConfig


class BudgetReached(RuntimeError):
    """The run's --max-hours or --max-cost was reached; committed shards stay."""


def limit_s(cfg: RunConfig) -> float | None:
    """The budget in seconds of wall time (the tighter of the two caps), or None for none."""
    caps = []
    if cfg.max_hours is not None:
        caps.append(cfg.max_hours * 3600)
    if cfg.max_cost is not None and cfg.price_per_hour:
        caps.append(cfg.max_cost / cfg.price_per_hour * 3600)
    return min(caps) if caps else None


def deadline(cfg: RunConfig, start_wall: float | None = None) -> float | None:
    """The instant (seconds since the epoch) the run must stop at, or None."""
    budget = limit_s(cfg)
    return None if budget is None else (time.time() if start_wall is None else start_wall) + budget


def words(cfg: RunConfig) -> str:
    """The caps as the user set them: "--max-hours 2", "--max-cost 5 at --price-per-hour 2.5 (2.0 h)"."""
    parts = []
    if cfg.max_hours is not None:
        parts.append(f"--max-hours {cfg.max_hours:g}")
    if cfg.max_cost is not None:
        parts.append(f"--max-cost {cfg.max_cost:g} at --price-per-hour {cfg.price_per_hour:g} "
                     f"({cfg.max_cost / cfg.price_per_hour:.2f} h)" if cfg.price_per_hour else
                     f"--max-cost {cfg.max_cost:g} at --price-per-hour 0 (no cap)")
    return " and ".join(parts)


def check(at: float | None, cfg: RunConfig) -> None:
    """Raise BudgetReached once the deadline `at` has passed (nothing when there is none)."""
    if at is not None and time.time() >= at:
        raise BudgetReached(f"the run reached its budget ({words(cfg)})")


def how_far(message: str, manifests: list[dict], num_shards: int, rows: int, run_id: str) -> str:
    """The line a stopped run ends with: what is committed, and the command that goes on."""
    done = sum(m.get("rows", 0) for m in manifests)
    return (f"{message}: {len(manifests)} of {num_shards} shards are committed ({done} of {rows} rows); the shard in "
            f"progress was not committed and is redone on resume. Nothing is lost: run the same command (--run-id "
            f"{run_id}) to go on, with a new budget")
