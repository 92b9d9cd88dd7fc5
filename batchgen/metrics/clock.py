"""One monotonic clock per process, expressed as seconds since the run's wall-clock start.

A resumed run continues the original run's time axis: the offset between this process's monotonic
origin and the run's start is taken once from the wall clock, then only perf_counter_ns advances.
"""

from __future__ import annotations

import time


class RunClock:
    def __init__(self, run_start_wall: float):
        self.run_start_wall = run_start_wall
        self._origin_ns = time.perf_counter_ns()
        self._offset_s = time.time() - run_start_wall

    def __call__(self) -> float:
        return self._offset_s + (time.perf_counter_ns() - self._origin_ns) * 1e-9
