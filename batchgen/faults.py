"""Deterministic faults for the fault-injection tests, as an object the run's parts are given.

`BATCHGEN_KILL_AT=<point>:<n>` makes the process SIGKILL itself the n-th time it passes `point`
(points: step, commit-staged, commit-published, shard-done, guard: inside a lease's guard, between
its flock and its read-judge-write). `BATCHGEN_STOP_AT=<point>:<n>` makes it SIGSTOP itself there
instead: a holder frozen in place, as a stopped or stuck process is, until someone sends SIGCONT. `BATCHGEN_FAIL_REQUESTS=<id>,<id>` makes
the native engine's step() raise whenever one of those requests is in its batch: a request that
breaks the engine, to test that it alone becomes an error row. `Faults.from_env()` reads both (the
fault tests set them for a subprocess); `Faults()` injects nothing and costs one comparison a call.
"""

from __future__ import annotations

import os
import signal


class Faults:
    def __init__(self, kill_at: str = "", fail_requests: frozenset[str] = frozenset(), stop_at: str = ""):
        self.at = {}  # point -> (n, signal): the n-th pass sends the process that signal
        for spec, sig in ((kill_at, signal.SIGKILL), (stop_at, signal.SIGSTOP)):
            point, _, n = spec.partition(":")
            if point:
                self.at[point] = (int(n or 1), sig)
        self.passed: dict[str, int] = {}
        self.fail_requests = frozenset(fail_requests)

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(os.environ.get("BATCHGEN_KILL_AT", ""),
                   frozenset(x for x in os.environ.get("BATCHGEN_FAIL_REQUESTS", "").split(",") if x),
                   os.environ.get("BATCHGEN_STOP_AT", ""))

    def checkpoint(self, point: str) -> None:
        if self.at and point in self.at:
            self.passed[point] = self.passed.get(point, 0) + 1
            n, sig = self.at[point]
            if self.passed[point] == n or (sig == signal.SIGKILL and self.passed[point] > n):
                os.kill(os.getpid(), sig)

    def fail_if_poisoned(self, request_ids: list[str]) -> None:
        if not self.fail_requests:
            return
        hit = self.fail_requests.intersection(request_ids)
        if hit:
            raise RuntimeError(f"injected fault: request {sorted(hit)[0]} breaks the engine step")

