"""Deterministic faults for the fault-injection tests, as an object the run's parts are given.

`BATCHGEN_KILL_AT=<point>:<n>` makes the process SIGKILL itself the n-th time it passes `point`
(points: step, commit-staged, commit-published, shard-done). `BATCHGEN_FAIL_REQUESTS=<id>,<id>` makes
the native engine's step() raise whenever one of those requests is in its batch: a request that
breaks the engine, to test that it alone becomes an error row. `Faults.from_env()` reads both (the
fault tests set them for a subprocess); `Faults()` injects nothing and costs one comparison a call.
"""

from __future__ import annotations

import os
import signal


class Faults:
    def __init__(self, kill_at: str = "", fail_requests: frozenset[str] = frozenset()):
        point, _, n = kill_at.partition(":")
        self.kill_point, self.kill_n, self.passed = point, int(n or 1), 0
        self.fail_requests = frozenset(fail_requests)

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(os.environ.get("BATCHGEN_KILL_AT", ""),
                   frozenset(x for x in os.environ.get("BATCHGEN_FAIL_REQUESTS", "").split(",") if x))

    def checkpoint(self, point: str) -> None:
        if self.kill_point and point == self.kill_point:
            self.passed += 1
            if self.passed >= self.kill_n:
                os.kill(os.getpid(), signal.SIGKILL)

    def fail_if_poisoned(self, request_ids: list[str]) -> None:
        if not self.fail_requests:
            return
        hit = self.fail_requests.intersection(request_ids)
        if hit:
            raise RuntimeError(f"injected fault: request {sorted(hit)[0]} breaks the engine step")

