"""Continuous batching with chunked prefill and preemption: pure Python, no torch (vLLM v1's shape).

Each step has a token budget, `max_num_batched_tokens`, spent in one forward pass:
1. the running requests first, oldest first: a decoding request takes one token, a request still
   prefilling takes the next chunk of its prompt. If the pool has no block for a request's next
   tokens, the newest running request is preempted (its blocks freed, itself put back at the front
   of the queue, recomputed later from its prompt and the tokens it already produced) until it has.
2. then waiting requests, while the budget, `max_num_seqs` and the pool allow: each takes its longest
   cached prefix from the prefix cache, then blocks for the chunk it computes now. Admission asks for
   the blocks needed now, never for the worst case.
   Which waiting request goes next (`admission`): "fifo" takes them as they came; "prefix" takes,
   among the first LOOKAHEAD waiting, the one with the most leading blocks in the prefix cache (its
   system prompt or few-shot block is cached, or shared with a running request, whose blocks are
   keyed as it is scheduled), the oldest among equals. So rows that share a prefix
   run while it is cached instead of each recomputing it after the others evicted it: requests group
   by their first blocks' keys without a sort (SGLang's longest-prefix-match policy, bounded).
   "length" takes, among the first LOOKAHEAD, the one with the most output tokens still allowed
   (max_tokens, within max_model_len), the oldest among equals: longest first, so that a shard does
   not end with one long row running alone while the batch is empty (LPT scheduling); "prefix-length"
   (the default) compares cached leading blocks first, then that length: where lengths are equal, it is
   "prefix". Each is bounded: a request passed over `max_passes` times (default 4 x max_num_seqs)
   goes next.
A long prompt therefore never stalls decoding for longer than one step's budget.

With n-gram speculation (batchgen.engine.speculative), a decoding request's chunk also carries the
proposed draft tokens: one pass scores them all, and the engine keeps those the sampler confirms.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.speculative import NgramProposer


@dataclass
class Chunk:
    """The tokens of one request computed in this step: positions start .. start + num_tokens - 1."""

    request: Request
    start: int
    num_tokens: int  # including the drafts
    drafts: list[int] = field(default_factory=list)  # speculative tokens after the newest one

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's newest token, so its logits give the next token (and,
        with drafts, each draft position's logits give the token after it)."""
        return self.start + self.num_tokens - len(self.drafts) == self.request.num_tokens

    @property
    def num_sampled(self) -> int:
        """Logits rows this chunk needs: one per position from the newest token on."""
        return 1 + len(self.drafts) if self.samples else 0

    @property
    def token_ids(self) -> list[int]:
        ids = self.request.all_token_ids[self.start:self.start + self.num_tokens - len(self.drafts)]
        return ids + self.drafts if self.drafts else ids

    @property
    def is_decode(self) -> bool:
        return self.num_tokens - len(self.drafts) == 1 and self.start >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)  # running requests first, then the admitted ones
    preempted: list[Request] = field(default_factory=list)  # back in the queue; their blocks are freed
    num_waiting: int = 0  # still waiting after this step's admissions
    num_lookup_tokens: int = 0  # tokens of the requests admitted this step, looked up in the prefix cache
    num_cached_tokens: int = 0  # of those, served by cached blocks (not computed)

    @property
    def num_running(self) -> int:
        return len(self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.drafts) for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)


LOOKAHEAD = 256  # waiting requests prefix-aware admission compares (bounded work per admission)
PREFIX_BLOCKS = 64  # leading blocks of a prompt compared (a system prompt, few-shot examples)
ADMISSIONS = ("prefix", "fifo", "length", "prefix-length")


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 proposer: NgramProposer | None = None, admission: str = "prefix-length", max_passes: int | None = None):
        if admission not in ADMISSIONS:
            raise ValueError(f"admission {admission!r}: one of {', '.join(ADMISSIONS)}")
        self.admission = admission
        self.by_prefix, self.by_length = admission in ("prefix", "prefix-length"), admission in ("length", "prefix-length")
        self.max_passes = max_passes if max_passes is not None else 4 * max_num_seqs
        self.blocks = blocks
        self.proposer = proposer  # drafts for decoding requests that allow speculation, or None
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first

    def add(self, request: Request) -> None:
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id}: {request.num_prompt_tokens} prompt tokens leave no room "
                             f"for output within max_model_len {self.max_model_len}")
        need = self.blocks.blocks_for(request.max_total_tokens(self.max_model_len))
        if need > self.blocks.num_blocks:  # it could never finish, even alone in the pool
            raise ValueError(f"request {request.request_id}: needs {need} KV blocks at most, the pool has "
                             f"{self.blocks.num_blocks}; raise --kv-cache-memory or lower max_tokens")
        if self.by_prefix and self.blocks.enable_prefix_caching:
            request.prefix_keys = self.blocks.prefix_keys(request.prompt_token_ids, PREFIX_BLOCKS)
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts(req, n, budget)
            if drafts and not self.blocks.allocate_slots(req, n + len(drafts)):
                drafts = []  # no room for the drafts: decode plainly before preempting anyone
            n += len(drafts)
            while not drafts and not self.blocks.allocate_slots(req, n):
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(Chunk(req, req.num_computed_tokens, n, drafts))
                # only confirmed tokens are keyed: a draft's position is not known to hold it
                self.blocks.cache_full_blocks(req, req.num_computed_tokens + n - len(drafts))
                budget -= n
                i += 1
                continue
            break
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            j = self._next_waiting()
            req = self.waiting[j]
            computed = self.blocks.computed_blocks(req)
            num_cached = len(computed) * self.blocks.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.blocks.allocate_slots(req, n, computed):
                break
            for k in range(j):  # admitted ahead of them
                self.waiting[k].passed_over += 1
            del self.waiting[j]
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            self.running.append(req)
            out.chunks.append(Chunk(req, num_cached, n))
            self.blocks.cache_full_blocks(req, num_cached + n)
            out.num_lookup_tokens += req.num_tokens
            out.num_cached_tokens += num_cached
            budget -= n
        out.num_waiting = len(self.waiting)
        return out

    def _next_waiting(self) -> int:
        """The index in `waiting` of the request to admit next (see the module's docstring)."""
        head = self.waiting[0]
        if (self.admission == "fifo" or len(self.waiting) == 1 or head.passed_over >= self.max_passes
                or head.num_preemptions):  # a preempted request resumes first, as in vLLM
            return 0
        best, best_score = 0, self._score(head)
        for j in range(1, min(len(self.waiting), LOOKAHEAD)):
            r = self.waiting[j]
            if r.passed_over >= self.max_passes:
                return j  # it has waited its bound
            if (len(r.prefix_keys), self._output_room(r)) > best_score:  # what it could score, at most
                score = self._score(r)
                if score > best_score:
                    best, best_score = j, score
        return best

    def _output_room(self, r: Request) -> int:
        """Length-aware admission's measure: the output tokens the request may still produce."""
        return r.max_total_tokens(self.max_model_len) - r.num_tokens if self.by_length else 0

    def _score(self, r: Request) -> tuple[int, int]:
        """(leading blocks in the prefix cache, output room): the larger goes first."""
        return (self.blocks.num_cached_leading(r.prefix_keys) if r.prefix_keys else 0), self._output_room(r)

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """Draft tokens for a decoding request, within the step's budget, its max_tokens and the context."""
        if self.proposer is None or n != 1 or not req.speculate or req.num_computed_tokens < req.num_prompt_tokens:
            return []
        limit = min(budget - 1, req.sampling.max_tokens - len(req.output_token_ids) - 1,
                    self.max_model_len - req.num_tokens - 1)
        return self.proposer.propose(req.request_id, req.all_token_ids, limit)

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def computed(self, chunk: Chunk, num_accepted: int = 0) -> None:
        """After the step: the chunk's K/V is in the cache, up to its accepted drafts (the positions of
        rejected ones hold K/V of tokens that were not produced; they are overwritten later)."""
        chunk.request.num_computed_tokens += chunk.num_tokens - len(chunk.drafts) + num_accepted

    def finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.running.remove(request)
        self.blocks.free(request)
        if self.proposer is not None:
            self.proposer.drop(request.request_id)

    def abort_all(self) -> list[Request]:
        """Forget every unfinished request and give back all its blocks."""
        dropped = list(self.waiting) + self.running
        for req in self.running:
            self.blocks.free(req)
        self.blocks.reset_prefix_cache()  # a failed step may have keyed blocks it never wrote
        self.waiting.clear()
        self.running = []
        if self.proposer is not None:
            for req in dropped:
                self.proposer.drop(req.request_id)
        return dropped
