"""A request's state inside the engine (plain Python, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchgen.config import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # the effective sampling seed (the request's own, or derived from the run seed and id)
    enqueue_t: float
    status: RequestStatus = RequestStatus.WAITING
    slot: int = -1  # KV-cache row while running
    output_token_ids: list[int] = field(default_factory=list)
    schedule_t: float | None = None
    first_token_t: float | None = None
    last_token_t: float | None = None
    finish_reason: str | None = None
    text: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def max_total_tokens(self, max_model_len: int) -> int:
        """KV positions this request may need at most: what admission reserves."""
        return min(self.num_prompt_tokens + self.sampling.max_tokens, max_model_len)
