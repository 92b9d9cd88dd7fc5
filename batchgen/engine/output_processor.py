"""After a step: the sampled tokens applied to their requests (speculative drafts accepted or not),
stops and lengths checked, finished requests detokenized, and the step's record (StepResult) made.
Host-side and pure Python over the scheduler's state, as vLLM's output processor is."""

from __future__ import annotations

from batchgen.engine.base import FinishedRequest, StepResult, step_bytes_read
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.repetition import looping
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler, SchedulerOutput


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, blocks: BlockManager, constraints, tokenizer, eos_token_ids: set[int],
                 max_model_len: int, step_bytes: tuple[int, int, int]):
        """`constraints`: batchgen.engine.structured.GrammarConstraints; `step_bytes`: the weights', a
        token's embedding row's and a context position's KV bytes (batchgen.engine.base.step_bytes_read)."""
        self.scheduler, self.blocks, self.constraints, self.tokenizer = scheduler, blocks, constraints, tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.bytes = step_bytes
        self.step_id = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0

    def process(self, sched: SchedulerOutput, sampled: list[int], logprobs: list | None, start_t: float,
                     end_t: float) -> StepResult:
        self.step_id += 1
        res = StepResult(step_id=self.step_id, start_t=start_t, end_t=end_t, num_running=sched.num_running,
                         num_waiting=sched.num_waiting,
                         num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
                         sum_context_len=0, bytes_read=0, num_preempted=len(sched.preempted),
                         num_cached_tokens=sched.num_cached_tokens, num_lookup_tokens=sched.num_lookup_tokens)
        samples = iter(sampled)
        lps = iter(logprobs) if logprobs is not None else None
        sum_ctx = 0
        for chunk in sched.chunks:
            r = chunk.request
            if r.schedule_t is None:
                r.schedule_t = start_t
            if not chunk.samples:
                self.scheduler.computed(chunk)
                continue  # a prompt chunk short of the end: no token yet
            drawn = [next(samples) for _ in range(chunk.num_sampled)]
            lp_rows = [next(lps) for _ in drawn] if lps is not None else [None] * len(drawn)
            accepted = 0  # drafts kept: up to the first that differs from what was sampled at its place
            while accepted < len(chunk.drafts) and chunk.drafts[accepted] == drawn[accepted]:
                accepted += 1
            self.num_draft_tokens += len(chunk.drafts)
            self.num_accepted_tokens += accepted
            res.num_draft_tokens += len(chunk.drafts)
            res.num_accepted_tokens += accepted
            self.scheduler.computed(chunk, accepted)
            for tok, lp in zip(drawn[:accepted + 1], lp_rows):
                sum_ctx += r.num_tokens  # the context this token was produced from
                if self._emit(res, r, tok, lp, lps is not None, end_t):
                    break
        res.sum_context_len = sum_ctx
        res.kv_blocks_used, res.kv_blocks_total = self.blocks.num_used_blocks, self.blocks.num_blocks
        num_tokens = sum(c.num_tokens for c in sched.chunks)
        res.bytes_read = step_bytes_read(bool(sched.chunks), num_tokens, sum_ctx, *self.bytes)
        return res

    def _emit(self, res: StepResult, r: Request, tok: int, lp, with_logprobs: bool, end_t: float) -> bool:
        """Record one produced token; True when it finishes the request."""
        context_len = r.num_tokens  # prompt + outputs before this token
        res.token_request_ids.append(r.request_id)
        res.token_indices.append(len(r.output_token_ids))
        res.token_context_lens.append(context_len)
        if with_logprobs:
            res.token_logprobs.append(None if lp is None else lp[0])
            res.token_top_logprobs.append(None if lp is None or r.sampling.logprobs == 0 else lp[1])
        if r.thought is not None:  # a reasoning budget may write the tokens that close the thought
            tok = r.thought.next_token(tok)
            r.thought.took(tok, len(r.output_token_ids))
        r.output_token_ids.append(tok)
        if r.first_token_t is None:
            r.first_token_t = end_t
        r.last_token_t = end_t
        reason = self._finish_reason(r, tok)
        if self.constraints.accept(r.request_id, tok) and reason is None:
            reason = "stop"  # the grammar is complete: nothing may follow
        if reason is None:
            return False
        self.scheduler.finish(r, reason)
        self.constraints.drop(r.request_id)
        res.finished.append(self._finished(r))
        return True

    def _finish_reason(self, r: Request, tok: int) -> str | None:
        sp = r.sampling
        if tok in self.eos_token_ids and not sp.ignore_eos:
            return "stop"
        if sp.stop:
            window = max(len(s) for s in sp.stop) + 8  # tokens: enough to hold any stop string ending now
            tail = self.tokenizer.decode(r.output_token_ids[-window:])
            if any(s in tail for s in sp.stop):
                return "stop"
        if len(r.output_token_ids) >= sp.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        if sp.stops_loops and looping(r.output_token_ids):
            return "repetition"
        return None

    def _finished(self, r: Request) -> FinishedRequest:
        reasoning, text, n_reasoning = (r.thought.split(r.output_token_ids, self.tokenizer.decode) if r.thought
                                        else (None, self.tokenizer.decode(r.output_token_ids), 0))
        if r.sampling.stop and r.finish_reason == "stop":
            cut = min((i for i in (text.find(s) for s in r.sampling.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]  # like vLLM, the stop string itself is not part of the output
        return FinishedRequest(r.request_id, r.num_prompt_tokens, r.output_token_ids, text, r.finish_reason,
                               r.enqueue_t, r.schedule_t, r.first_token_t, r.last_token_t,
                               num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
                               reasoning=reasoning, reasoning_tokens=n_reasoning if reasoning is not None else None,
                               reasoning_cut=r.thought.cut if reasoning is not None else None)
