"""The one small interface every engine implements, and what a step hands back.

    engine.add(request_id, prompt_token_ids, sampling)   # may raise RequestRejected
    while engine.has_unfinished():
        result = engine.step()                           # StepResult: per-step stats, token events, finished
    engine.abort_all()                                   # after a failed step: drop what is unfinished

Times are seconds on the engine's clock (monotonic, relative to the run start), taken after the
device has synchronized for the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from batchgen.config import SamplingParams
from batchgen.engine.plan import EnginePlan


class RequestRejected(ValueError):
    """The engine refused one request (too long, invalid parameters); the run goes on."""


class EngineDead(RuntimeError):
    """The engine cannot go on (a dead vLLM core, a lost device): the shard fails and is retried.
    Any other exception from step() is treated as possibly one request's fault and isolated."""


@dataclass
class FinishedRequest:
    request_id: str
    prompt_tokens: int
    output_token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length" (max_tokens or context limit) | "repetition"
    enqueue_t: float
    schedule_t: float
    first_token_t: float
    last_token_t: float
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache (None: not reported)
    num_preemptions: int | None = None
    # a thinking model's thought, apart from `text` (the answer): None where the model has no think
    # markers or the row answered without one (batchgen.engine.reasoning)
    reasoning: str | None = None
    reasoning_tokens: int | None = None  # of output_token_ids, the thought's, markers included
    reasoning_cut: bool | None = None  # its budget (max_reasoning_tokens) closed the thought


def step_bytes_read(ran: bool, num_tokens: int, sum_context_len: int, weight_bytes: int, row_embed_bytes: int,
                    kv_bytes_per_token: int) -> int:
    """METRICS' estimate of a step's bytes from memory, for either engine: the weights once if the step
    ran, each computed token's embedding row, and the KV of every context it attended over."""
    return (weight_bytes if ran else 0) + num_tokens * row_embed_bytes + kv_bytes_per_token * sum_context_len


@dataclass
class StepResult:
    step_id: int
    start_t: float
    end_t: float
    num_running: int  # sequences in this step's batch (prefill + decode)
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    sum_context_len: int
    bytes_read: int  # METRICS.md estimate: weights touched + KV read
    num_preempted: int | None = None  # requests preempted this step (None where the engine does not say)
    num_cached_tokens: int | None = None  # prompt tokens of this step's admissions served by the prefix cache
    num_lookup_tokens: int | None = None  # prompt tokens of this step's admissions looked up in it
    kv_blocks_used: int | None = None  # KV pool occupancy after the step
    kv_blocks_total: int | None = None
    num_draft_tokens: int = 0  # speculative tokens proposed this step
    num_accepted_tokens: int = 0  # of those, confirmed by the target model (each saves a pass)
    # one entry per token produced in this step (parallel lists: cheap to build, cheap to append)
    token_request_ids: list[str] = field(default_factory=list)
    token_indices: list[int] = field(default_factory=list)
    token_context_lens: list[int] = field(default_factory=list)
    # where the request asked for logprobs (None elsewhere): the chosen token's, and the top alternatives
    token_logprobs: list[float | None] = field(default_factory=list)
    token_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


class Engine(ABC):
    name: str = "?"
    tokenizer: Any  # batchgen.model.tokenizer.Tokenizer: input processing happens before add()
    max_model_len: int
    plan: EnginePlan  # what it runs, resolved once (batchgen.engine.resolve.plan_engine)

    @abstractmethod
    def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None: ...

    @abstractmethod
    def step(self) -> StepResult: ...

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def abort_all(self) -> list[str]:
        """Drop every unfinished request (waiting or running) and return their ids; the engine is
        then empty and ready for new requests. Used to isolate a request that makes step() fail."""

    @abstractmethod
    def conditions(self) -> dict[str, Any]:
        """Engine-side run conditions (version, dtype, batch and KV limits, device)."""

    def close(self) -> None:
        pass


def monotonic_clock() -> Callable[[], float]:
    """Seconds since this call, from perf_counter_ns."""
    import time

    t0 = time.perf_counter_ns()
    return lambda: (time.perf_counter_ns() - t0) * 1e-9
