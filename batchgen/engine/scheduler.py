"""Continuous-batching scheduler: pure Python, no torch.

Each step it admits waiting requests into free KV-cache slots while the KV token budget and the
per-step prefill token budget allow, longest prompt first (so a step's prefill batch pads little
and the run's tail is made of short requests). Admission reserves a request's worst case
(prompt + max_tokens, capped by max_model_len), so a running sequence never runs out of cache
and nothing is ever preempted.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from batchgen.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    prefill: list[Request] = field(default_factory=list)  # admitted this step, slot assigned, no KV yet
    decode: list[Request] = field(default_factory=list)  # running, each feeds its newest token
    num_waiting: int = 0  # still waiting after this step's admissions

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.prefill)

    @property
    def num_running(self) -> int:
        return len(self.prefill) + len(self.decode)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_model_len: int, kv_budget_tokens: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_budget_tokens = kv_budget_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: list[tuple[int, int, Request]] = []  # heap of (-prompt_len, arrival, request)
        self._arrival = itertools.count()
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs))  # a heap: the lowest slot first keeps rows dense
        self.kv_reserved_tokens = 0

    def add(self, request: Request) -> None:
        need = request.max_total_tokens(self.max_model_len)
        if request.num_prompt_tokens >= self.max_model_len or need > self.kv_budget_tokens:
            raise ValueError(f"request {request.request_id}: {request.num_prompt_tokens} prompt tokens do not fit "
                             f"max_model_len {self.max_model_len} / KV budget {self.kv_budget_tokens}")
        heapq.heappush(self._waiting, (-request.num_prompt_tokens, next(self._arrival), request))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running)

    @property
    def max_active_slot(self) -> int:
        return max((r.slot for r in self.running), default=-1)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(decode=list(self.running))
        prefill_tokens = 0
        while self._waiting and self._free_slots:
            req = self._waiting[0][2]
            need = req.max_total_tokens(self.max_model_len)
            if self.kv_reserved_tokens + need > self.kv_budget_tokens:
                break
            if out.prefill and prefill_tokens + req.num_prompt_tokens > self.max_num_batched_tokens:
                break  # the first admission of a step always goes, however long
            heapq.heappop(self._waiting)
            req.slot = heapq.heappop(self._free_slots)
            req.status = RequestStatus.RUNNING
            self.kv_reserved_tokens += need
            prefill_tokens += req.num_prompt_tokens
            out.prefill.append(req)
        self.running.extend(out.prefill)
        out.num_waiting = len(self._waiting)
        return out

    def finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.running.remove(request)
        heapq.heappush(self._free_slots, request.slot)
        self.kv_reserved_tokens -= request.max_total_tokens(self.max_model_len)

    def abort_all(self) -> list[Request]:
        """Forget every unfinished request and free all slots and reservations."""
        dropped = [r for _, _, r in self._waiting] + self.running
        self._waiting.clear()
        self.running = []
        self._free_slots = list(range(self.max_num_seqs))
        self.kv_reserved_tokens = 0
        return dropped
