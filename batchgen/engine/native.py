"""NativeEngine = scheduler + model + KV cache + sampler, in pure PyTorch (CPU or CUDA).

A step: schedule -> decode the running rows (one token each, K/V from the cache) -> prefill the
requests admitted this step -> one host sync for all sampled tokens -> bookkeeping.
Per-slot state (newest token, position, sampling parameters, output counter) lives in small
device tensors allocated once, so a decode step uploads nothing and syncs once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import torch

import batchgen
from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine.base import Engine, FinishedRequest, RequestRejected, StepResult, monotonic_clock
from batchgen.engine.kv_cache import KVCache
from batchgen.engine.request import Request
from batchgen.engine.sampler import Sampler
from batchgen.faults import fail_if_poisoned, fault_requests_active
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.model.loader import DTYPES, load_model, read_model_config
from batchgen.model.tokenizer import Tokenizer


def derive_seed(run_seed: int, request_id: str) -> int:
    """A request's seed when it has none: stable across runs, processes and batch composition."""
    digest = hashlib.blake2b(f"{run_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


class NativeEngine(Engine):
    name = "native"

    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] | None = None):
        self.config = config
        self.model_dir = Path(model_dir)
        model_config = read_model_config(model_dir)
        self.max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
        self.model = load_model(model_dir, config.dtype, config.device, max_positions=self.max_model_len)
        self.tokenizer = Tokenizer(model_dir)
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.clock = clock or monotonic_clock()
        dev, slots = config.device, config.max_num_seqs
        c = model_config
        self.kv = (KVCache(c.num_layers, slots, self.max_model_len, c.num_kv_heads, c.head_dim,
                           DTYPES[config.dtype], dev) if config.enable_kv_cache else None)
        self.scheduler = Scheduler(slots, self.max_model_len, config.kv_budget_tokens, config.max_num_batched_tokens)
        self.sampler = Sampler(c.vocab_size, dev)
        i64 = dict(dtype=torch.int64, device=dev)
        self.slot_token = torch.zeros(slots, **i64)  # newest token of the slot's sequence
        self.slot_pos = torch.zeros(slots, **i64)  # the position that token will occupy
        self.slot_count = torch.zeros(slots, **i64)  # output tokens so far (the sampler's counter)
        self.slot_seed = torch.zeros(slots, **i64)
        self.slot_top_k = torch.zeros(slots, **i64)
        self.slot_temp = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.slot_top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.rows = torch.arange(slots, **i64)
        self.key_pos = torch.arange(self.max_model_len, **i64)
        self.kv_bytes_per_token = c.kv_bytes_per_token(torch.finfo(DTYPES[config.dtype]).bits // 8)
        self.row_embed_bytes = c.hidden_size * (torch.finfo(DTYPES[config.dtype]).bits // 8)
        self.num_computed_positions = 0  # positions run through the model (the lab's count)
        self._step_id = 0
        self._ids: set[str] = set()

    # ---- the interface -------------------------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestRejected("empty prompt: no tokens to condition on")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                                  f"and at least one output token must fit")
        if request_id in self._ids:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        self._ids.add(request_id)
        seed = sampling.seed if sampling.seed is not None else derive_seed(self.config.seed, request_id)
        self.scheduler.add(Request(request_id, list(prompt_token_ids), sampling, seed, enqueue_t=self.clock()))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> list[str]:
        self._ids.clear()
        return [r.request_id for r in self.scheduler.abort_all()]

    def step(self) -> StepResult:
        start_t = self.clock()
        sched = self.scheduler.schedule()
        if fault_requests_active():
            fail_if_poisoned([r.request_id for r in sched.prefill + sched.decode])
        parts: list[torch.Tensor] = []
        num_passes = 0
        if sched.decode:
            parts.append(self._decode(sched.decode))
            num_passes += 1
        if sched.prefill:
            parts.append(self._prefill(sched.prefill))
            num_passes += 1
        sampled = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()  # the one host sync
        end_t = self.clock()
        return self._postprocess(sched, sampled, start_t, end_t, num_passes)

    def conditions(self) -> dict[str, Any]:
        c = self.config
        return {
            "engine": self.name, "engine_version": batchgen.__version__, "torch_version": torch.__version__,
            "dtype": c.dtype, "quantization": None, "device": c.device, "torch_threads": torch.get_num_threads(),
            "max_num_seqs": c.max_num_seqs, "max_model_len": self.max_model_len,
            "kv_budget_tokens": c.kv_budget_tokens, "max_num_batched_tokens": c.max_num_batched_tokens,
            "kv_cache_bytes": self.kv.nbytes if self.kv else 0, "enable_kv_cache": c.enable_kv_cache,
            "weight_bytes": self.model.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "speculative": None,
        }

    # ---- forward passes ------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor | slice, reqs: list[Request]) -> torch.Tensor:
        all_greedy = all(r.sampling.greedy for r in reqs)
        use_top = any(r.sampling.top_k > 0 or r.sampling.top_p < 1.0 for r in reqs if not r.sampling.greedy)
        return self.sampler(logits, self.slot_temp[rows], self.slot_top_p[rows], self.slot_top_k[rows],
                            self.slot_seed[rows], self.slot_count[rows], all_greedy, use_top)

    def _decode(self, reqs: list[Request]) -> torch.Tensor:
        """One token for every running row 0..hi-1 (free rows in between compute harmlessly)."""
        hi = max(r.slot for r in reqs) + 1
        attn_len = max(r.num_tokens for r in reqs)  # S: positions 0..newest
        pos = self.slot_pos[:hi]
        if self.kv is not None:
            bias = torch.zeros(hi, attn_len, dtype=self.model.dtype, device=pos.device)
            bias.masked_fill_(self.key_pos[None, :attn_len] > pos[:, None], float("-inf"))
            logits = self.model.decode(self.slot_token[:hi], pos, self.rows[:hi], self.kv, attn_len,
                                       bias.view(hi, 1, 1, attn_len))
            self.num_computed_positions += len(reqs)
        else:  # recompute the whole history of every row (the lab's baseline)
            seqs = [[0] for _ in range(hi)]
            for r in reqs:
                seqs[r.slot] = r.prompt_token_ids + r.output_token_ids
            logits = self._full_forward(seqs)
            self.num_computed_positions += sum(r.num_tokens for r in reqs)
        tokens = self._sample(logits, slice(0, hi), reqs)
        self.slot_token[:hi] = tokens
        self.slot_pos[:hi].add_(1).clamp_(max=self.max_model_len - 1)  # free rows must stay in bounds
        self.slot_count[:hi] += 1
        return tokens

    def _prefill(self, reqs: list[Request]) -> torch.Tensor:
        dev = self.slot_pos.device
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=dev)
        s = [r.sampling for r in reqs]
        self.slot_temp[slots] = torch.tensor([float(x.temperature) for x in s], device=dev)
        self.slot_top_p[slots] = torch.tensor([float(x.top_p) for x in s], device=dev)
        self.slot_top_k[slots] = torch.tensor([x.top_k for x in s], dtype=torch.int64, device=dev)
        self.slot_seed[slots] = torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=dev)
        self.slot_count[slots] = 0
        logits = self._full_forward([r.prompt_token_ids for r in reqs], slots if self.kv is not None else None)
        self.num_computed_positions += sum(r.num_prompt_tokens for r in reqs)
        tokens = self._sample(logits, slots, reqs)
        self.slot_token[slots] = tokens
        self.slot_pos[slots] = torch.tensor([r.num_prompt_tokens for r in reqs], dtype=torch.int64, device=dev)
        self.slot_count[slots] = 1
        return tokens

    def _full_forward(self, seqs: list[list[int]], slots: torch.Tensor | None = None) -> torch.Tensor:
        """Causal forward over right-padded sequences; returns logits at each one's last token."""
        width = max(len(x) for x in seqs)
        dev = self.slot_pos.device
        tokens = torch.tensor([x + [0] * (width - len(x)) for x in seqs], dtype=torch.int64, device=dev)
        last = torch.tensor([len(x) - 1 for x in seqs], dtype=torch.int64, device=dev)
        return self.model.prefill(tokens, last, self.kv if slots is not None else None, slots)

    # ---- bookkeeping (host side) ---------------------------------------------------------------

    def _postprocess(self, sched: SchedulerOutput, sampled: list[int], start_t: float, end_t: float,
                     num_passes: int) -> StepResult:
        self._step_id += 1
        hi = max((r.slot for r in sched.decode), default=-1) + 1
        res = StepResult(step_id=self._step_id, start_t=start_t, end_t=end_t, num_running=sched.num_running,
                         num_waiting=sched.num_waiting, num_prefill_tokens=sched.num_prefill_tokens,
                         num_decode_tokens=len(sched.decode), sum_context_len=0, bytes_read=0)
        pairs = [(r, sampled[r.slot]) for r in sched.decode]
        pairs += [(r, sampled[hi + i]) for i, r in enumerate(sched.prefill)]
        for r in sched.prefill:
            r.schedule_t = start_t
        sum_ctx = 0
        for r, tok in pairs:
            context_len = r.num_tokens  # prompt + outputs before this token
            sum_ctx += context_len
            res.token_request_ids.append(r.request_id)
            res.token_indices.append(len(r.output_token_ids))
            res.token_context_lens.append(context_len)
            r.output_token_ids.append(tok)
            if r.first_token_t is None:
                r.first_token_t = end_t
            r.last_token_t = end_t
            reason = self._finish_reason(r, tok)
            if reason is not None:
                self.scheduler.finish(r, reason)
                self._ids.discard(r.request_id)
                res.finished.append(self._finished(r))
        res.sum_context_len = sum_ctx
        res.bytes_read = (num_passes * self.model.weight_bytes + len(pairs) * self.row_embed_bytes
                          + self.kv_bytes_per_token * sum_ctx)
        return res

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
        return None

    def _finished(self, r: Request) -> FinishedRequest:
        text = self.tokenizer.decode(r.output_token_ids)
        if r.sampling.stop and r.finish_reason == "stop":
            cut = min((i for i in (text.find(s) for s in r.sampling.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]  # like vLLM, the stop string itself is not part of the output
        return FinishedRequest(r.request_id, r.num_prompt_tokens, r.output_token_ids, text, r.finish_reason,
                               r.enqueue_t, r.schedule_t, r.first_token_t, r.last_token_t)
