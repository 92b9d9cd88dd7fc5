"""NativeEngine: scheduler + block manager + model runner, in pure PyTorch (CPU or CUDA).

The engine only orchestrates (nano-vllm's seams): the scheduler (pure Python) picks each step's
chunks under the token budget and the KV pool, the block manager (pure Python) owns the block
tables and the prefix cache, and the model runner owns the device tensors and runs one forward pass
over the step, with one host sync. Bookkeeping after the step (stops, timings, events) is host-side.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

import batchgen
from batchgen.config import DTYPE_BYTES, EngineConfig, SamplingParams, batchgen_home, derive_seed
from batchgen.engine.attention import TorchPagedAttention, select_backend
from batchgen.engine.base import (Engine, FinishedRequest, RequestRejected, StepResult, monotonic_clock,
                                  step_bytes_read)
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.decode_graphs import DecodeGraphs
from batchgen.engine.kv_cache import PagedKVCache, free_memory_bytes
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.precision import decode_matrices, resolve_dtype, resolve_fp32_kernel
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.speculative import NgramProposer
from batchgen.engine.structured import GrammarConstraints
from batchgen.faults import fail_if_poisoned, fault_requests_active
from batchgen.model import ggml
from batchgen.model.linear import INT4_GROUP, can_int4
from batchgen.model.llama import LlamaModel
from batchgen.model.loader import DTYPES, load_model, read_model_config
from batchgen.model.tokenizer import Tokenizer


class NativeEngine(Engine):
    name = "native"

    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] | None = None, *, model: LlamaModel | None = None, tokenizer=None):
        """`model` (with `tokenizer`): an already built model, e.g. random weights of a large shape
        for a benchmark (batchgen.model.random_init); then config.dtype is the model's."""
        self.config = config
        self.model_dir = Path(model_dir)
        c = model.config if model is not None else read_model_config(model_dir)
        self.max_model_len = min(config.max_model_len, c.max_position_embeddings)
        if model is not None:
            self.model, self.dtype, self.dtype_choice = model, str(model.dtype).removeprefix("torch."), "the model's"
        else:
            fp32, fp32_why = config.fp32_kernel, None
            if config.quantization == "int4":
                if not can_int4(config.device):
                    raise ValueError(f"quantization int4 needs PyTorch's int4 CPU kernel; device {config.device!r} "
                                     f"has none here (on CUDA, serve a quantized checkpoint with the vllm engine)")
                self.dtype, self.dtype_choice = "bfloat16", "int4 weights: the kernel's activations"
            elif config.quantization == "gguf":
                self.dtype, self.dtype_choice = "float32", "gguf blocks: the kernel's activations"
            else:
                if config.dtype in ("auto", "float32") and config.pack_weights and config.device == "cpu":
                    # float32's kernel for this batch band first: `--dtype auto` compares float32 on it
                    fp32, fp32_why = resolve_fp32_kernel(config.fp32_kernel, config.device, config.max_num_seqs,
                                                         decode_matrices(c))
                self.dtype, self.dtype_choice = resolve_dtype(config.dtype, config.device, config.max_num_seqs, fp32)
            self.model = load_model(model_dir, self.dtype, config.device, max_positions=self.max_model_len,
                                    pack_weights=config.pack_weights, quantization=config.quantization,
                                    fp32_kernel=fp32)
            if self.dtype == "float32" and config.fp32_kernel == "auto" and fp32_why:
                self.model.layout_note = fp32_why  # which kernel auto took for this band, and the figures
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(model_dir)
        self.eos_token_ids = set(c.eos_token_ids)
        self.clock = clock or monotonic_clock()
        bpe = DTYPE_BYTES[self.dtype]
        self.kv_bytes_per_token = c.kv_bytes_per_token(bpe)
        self.row_embed_bytes = c.hidden_size * bpe
        bs = config.block_size
        block_bytes = PagedKVCache.block_bytes(c.num_layers, bs, c.num_kv_heads, c.head_dim, bpe)
        pool_bytes = config.kv_pool_bytes(self.kv_bytes_per_token, free_memory_bytes(config.device))
        most_useful = config.max_num_seqs * -(-self.max_model_len // bs)  # more could never be used at once
        num_blocks = max(1, min(pool_bytes // block_bytes, most_useful))
        self.blocks = BlockManager(num_blocks, bs, config.enable_prefix_caching and config.enable_kv_cache)
        attention = select_backend(config.device, config.attention_backend) if config.enable_kv_cache else None
        graphs_mode = self._graphs_mode(config, attention)
        graphs = graphs_mode is not None
        # with decode graphs, one more block than the allocator hands out: the padding rows' scratch block
        kv = (PagedKVCache(c.num_layers, num_blocks + graphs, bs, c.num_kv_heads, c.head_dim, DTYPES[self.dtype],
                           config.device, attention.kv_layout) if attention else None)
        self.constraints = GrammarConstraints(model_dir, c.vocab_size, sorted(self.eos_token_ids))
        self.runner = ModelRunner(self.model, kv, attention, c.vocab_size, config.device, self.constraints,
                                  config.sampler)
        if config.compile != "off":  # Inductor's on-disk cache beside the probe's: a machine compiles once
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(batchgen_home() / "inductor"))
        if graphs:
            self.runner.graphs = DecodeGraphs(self.model, kv, attention, scratch_block=num_blocks,
                                              device=config.device, mode=graphs_mode,
                                              compile_after_s=0.0 if config.compile == "on" else None)
        self.compile_s = self._compile(config)
        self.proposer = (NgramProposer(config.speculative_ngram, config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.speculative_ngram and config.enable_kv_cache else None)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, self.max_model_len, config.max_num_batched_tokens,
                                   self.proposer)
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self._step_id = 0
        self._ids: set[str] = set()

    @staticmethod
    def _graphs_mode(config: EngineConfig, attention) -> str | None:
        """How decode-only steps run in static buckets (batchgen.engine.decode_graphs), or None (not at
        all). On CUDA: captured graphs (`--cuda-graphs`). On CPU: the whole step compiled per bucket
        (`--compile on`, or `auto`: once a bucket's eager time would have paid for it), or, with
        `--cuda-graphs on` and compile not asked for, the padded buckets run eagerly (the GPU path's
        bucketing, checkable without a GPU)."""
        if attention is None or not isinstance(attention, TorchPagedAttention):
            return None  # no cache (the lab), or a kernel that plans on the host each step (FlashInfer)
        if config.device.startswith("cuda"):
            return "capture" if config.cuda_graphs in ("on", "auto") else None
        if config.compile == "on" or (config.compile == "auto" and config.cuda_graphs != "on"):
            return "compile"
        return "eager" if config.cuda_graphs == "on" else None

    def _compile(self, config: EngineConfig) -> float | None:
        """The step's elementwise pieces compiled (RMSNorm, RoPE, the gated activation): on CUDA with
        `--compile auto|on`, and on CPU where `--compile on` has no whole step to compile (no KV cache).
        Where the decode step is compiled whole per bucket (CPU), that is done on each bucket's first use
        instead (see decode_graphs). Returns the seconds the compile took (paid here, on a warm-up
        forward, not inside the first step)."""
        on = config.compile == "on" or (config.compile == "auto" and config.device.startswith("cuda"))
        if not on or self.model.compiled or (self.runner.graphs and self.runner.graphs.mode == "compile"):
            return None
        t0 = time.perf_counter()
        # on CUDA, Inductor's reduce-overhead mode records the compiled kernels as CUDA graphs, unless the
        # whole decode step is captured (decode_graphs): graphs inside that capture would nest
        whole_step = self.runner.graphs is not None and self.runner.graphs.capture
        self.model.compile("reduce-overhead" if config.device.startswith("cuda") and not whole_step else None)
        try:
            self.model.warm_up()
        except Exception as e:  # a compiler that fails here must not take the run down: eager still works
            if config.compile == "on":
                raise
            self.model.uncompile(f"failed ({type(e).__name__}: {str(e)[:200]}), eager")
        return time.perf_counter() - t0

    @property
    def num_computed_positions(self) -> int:
        """Positions run through the model (the lab's count)."""
        return self.runner.num_computed_positions

    @property
    def sample_seconds(self) -> float:
        """Seconds spent choosing tokens from logits so far (argmax or the sampler; see ModelRunner)."""
        return self.runner.sample_s

    # ---- the interface -------------------------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestRejected("empty prompt: no tokens to condition on")
        if request_id in self._ids:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        if sampling.lora:
            raise RequestRejected(f"LoRA adapter {sampling.lora!r}: the native engine runs no adapters; use --engine vllm")
        # rows get their seed where they become requests (batchgen.data.prompts); this covers direct callers
        seed = sampling.seed if sampling.seed is not None else derive_seed(self.config.seed, request_id)
        try:
            if sampling.structured:
                self.constraints.add(request_id, sampling.structured)  # compiles first: a bad spec is this row's
            # a grammar or logprobs go one token at a time: no drafts for them
            speculate = not sampling.structured and sampling.logprobs is None
            self.scheduler.add(Request(request_id, list(prompt_token_ids), sampling, seed, enqueue_t=self.clock(),
                                       speculate=speculate))
        except ValueError as e:
            self.constraints.drop(request_id)
            raise RequestRejected(str(e)) from None
        self._ids.add(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> list[str]:
        self._ids.clear()
        self.constraints.matchers.clear()
        return [r.request_id for r in self.scheduler.abort_all()]

    def step(self) -> StepResult:
        start_t = self.clock()
        sched = self.scheduler.schedule()
        if fault_requests_active():
            fail_if_poisoned([c.request.request_id for c in sched.chunks])
        sampled, logprobs = self.runner.execute(sched.chunks)  # one host sync
        end_t = self.clock()
        return self._postprocess(sched, sampled, logprobs, start_t, end_t)

    def close(self) -> None:
        """Give the KV pool back now (a process that builds another engine should not hold two)."""
        self.runner.kv = None

    def _quantization(self) -> str | None:
        if self.config.quantization == "int4":
            return f"int4 weight-only, group {INT4_GROUP}, scale+zero (layers; head {self.dtype})"
        if self.config.quantization == "gguf":  # which block formats, and the instruction set the kernel runs
            kinds = sorted({m.kind for l in self.model.layers for m in (l.qkv, l.o, l.gate_up, l.down)
                            if hasattr(m, "kind")} | ({self.model.lm_head.kind} if hasattr(self.model.lm_head, "kind")
                                                      else set()))
            return f"gguf blocks as shipped ({', '.join(kinds)}), batchgen qgemv on {ggml.isa_name()}"
        return None

    def conditions(self) -> dict[str, Any]:
        c, kv = self.config, self.runner.kv
        return {
            "engine": self.name, "engine_version": batchgen.__version__, "torch_version": torch.__version__,
            "dtype": self.dtype, "dtype_choice": self.dtype_choice, "weight_layout": self.model.weight_layout,
            "quantization": self._quantization(), "device": c.device, "torch_threads": torch.get_num_threads(),
            "max_num_seqs": c.max_num_seqs, "max_model_len": self.max_model_len,
            "kv_budget_tokens": self.blocks.num_blocks * self.blocks.block_size, "kv_block_size": self.blocks.block_size,
            "kv_num_blocks": self.blocks.num_blocks, "kv_cache_bytes": kv.nbytes if kv else 0,
            "enable_prefix_caching": self.blocks.enable_prefix_caching,
            "max_num_batched_tokens": c.max_num_batched_tokens, "enable_kv_cache": c.enable_kv_cache,
            "attention_backend": self.runner.attention.name if self.runner.attention else "none (recompute)",
            "weight_bytes": self.model.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "sampler": self.runner.sampler.name,
            "compile": self._compile_condition(), "compile_s": self._compile_seconds(),
            "cuda_graphs": self._graphs_condition(),
            "speculative": ({"method": "ngram", "num_speculative_tokens": c.speculative_ngram,
                             "prompt_lookup_min": c.prompt_lookup_min, "prompt_lookup_max": c.prompt_lookup_max}
                            if self.proposer else None),
        }

    def _graphs_condition(self) -> str:
        g = self.runner.graphs
        return "off" if g is None else g.describe()

    def _compile_condition(self) -> str:
        g = self.runner.graphs
        if g is not None and g.mode == "compile":
            return ("auto: " if g.auto else "") + "whole decode step per bucket" + (
                f"; failed ({g.failed}), eager" if g.failed else "")
        return self.model.compiled or "off"

    def _compile_seconds(self) -> float | None:
        g = self.runner.graphs
        return g.compile_s if g is not None and g.mode == "compile" else self.compile_s

    # ---- bookkeeping (host side) ---------------------------------------------------------------

    def _postprocess(self, sched: SchedulerOutput, sampled: list[int], logprobs: list | None, start_t: float,
                     end_t: float) -> StepResult:
        self._step_id += 1
        res = StepResult(step_id=self._step_id, start_t=start_t, end_t=end_t, num_running=sched.num_running,
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
        res.bytes_read = step_bytes_read(bool(sched.chunks), num_tokens, sum_ctx, self.model.weight_bytes,
                                         self.row_embed_bytes, self.kv_bytes_per_token)
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
        self._ids.discard(r.request_id)
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
        return None

    def _finished(self, r: Request) -> FinishedRequest:
        text = self.tokenizer.decode(r.output_token_ids)
        if r.sampling.stop and r.finish_reason == "stop":
            cut = min((i for i in (text.find(s) for s in r.sampling.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]  # like vLLM, the stop string itself is not part of the output
        return FinishedRequest(r.request_id, r.num_prompt_tokens, r.output_token_ids, text, r.finish_reason,
                               r.enqueue_t, r.schedule_t, r.first_token_t, r.last_token_t,
                               num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions)
