"""Deterministic crash points for the fault-injection tests.

`BATCHGEN_KILL_AT=<point>:<n>` makes the process SIGKILL itself the n-th time it passes `point`
(points: step, commit-staged, commit-published, shard-done). Unset, this costs one dict lookup.
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
