"""A request's state inside the engine (plain Python, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchgen.config import SamplingParams
from batchgen.engine.reasoning import Thought


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
    output_token_ids: list[int] = field(default_factory=list)
    # paged KV: the blocks holding positions 0..num_computed_tokens-1 (and room for this step's)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache keys of its full computed blocks
    num_computed_tokens: int = 0  # positions whose K/V is in the cache
    num_cached_tokens: int = 0  # prompt positions served by the prefix cache at its (last) admission
    num_preemptions: int = 0
    schedule_t: float | None = None
    first_token_t: float | None = None
    last_token_t: float | None = None
    finish_reason: str | None = None
    speculate: bool = True  # may take n-gram drafts (not with a grammar or logprobs: one token at a time)
    # prefix-aware admission (batchgen.engine.scheduler): the prefix-cache keys of the prompt's first full
    # blocks (set when it is queued), and how often a request queued behind it was admitted first
    prefix_keys: tuple[int, ...] = ()
    passed_over: int = 0
    thought: Thought | None = None  # a thinking model's reasoning as it comes (batchgen.engine.reasoning)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs: what a preempted request recomputes."""
        return self.prompt_token_ids + self.output_token_ids if self.output_token_ids else self.prompt_token_ids

    def max_total_tokens(self, max_model_len: int) -> int:
        """KV positions this request may need at most."""
        return min(self.num_prompt_tokens + self.sampling.max_tokens, max_model_len)
