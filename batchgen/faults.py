"""Deterministic faults for the fault-injection tests.

`BATCHGEN_KILL_AT=<point>:<n>` makes the process SIGKILL itself the n-th time it passes `point`
(points: step, commit-staged, commit-published, shard-done). Unset, this costs one dict lookup.
`BATCHGEN_FAIL_REQUESTS=<id>,<id>` makes the native engine's step() raise whenever one of those
requests is in its batch: a request that breaks the engine, to test that it alone becomes an error row.
"""

from __future__ import annotations

import os
import signal

_spec = os.environ.get("BATCHGEN_KILL_AT", "")
_point, _, _n = _spec.partition(":")
_count = {"n": 0}


def checkpoint(point: str) -> None:
    if _spec and point == _point:
        _count["n"] += 1
        if _count["n"] >= int(_n or 1):
            os.kill(os.getpid(), signal.SIGKILL)


_poison = frozenset(x for x in os.environ.get("BATCHGEN_FAIL_REQUESTS", "").split(",") if x)


def fault_requests_active() -> bool:
    return bool(_poison)


def fail_if_poisoned(request_ids: list[str]) -> None:
    hit = _poison.intersection(request_ids)
    if hit:
        raise RuntimeError(f"injected fault: request {sorted(hit)[0]} breaks the engine step")
