"""NativeEngine: scheduler + block manager + model runner, in pure PyTorch (CPU or CUDA).

The engine only orchestrates (nano-vllm's seams): the scheduler (pure Python) picks each step's
chunks under the token budget and the KV pool, the block manager (pure Python) owns the block
tables and the prefix cache, the model runner owns the device (dtype and kernels, weights, the KV
pool, attention, compile and graphs, the sampler) and runs one forward pass over the step with one
host sync, and the output processor applies the step's tokens (stops, drafts, timings) host-side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

import batchgen
from batchgen.config import EngineConfig, SamplingParams, derive_seed
from batchgen.engine.base import Engine, RequestRejected, StepResult, monotonic_clock
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.output_processor import OutputProcessor
from batchgen.engine.plan import EnginePlan
from batchgen.engine.reasoning import Thought, markers_of
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.speculative import NgramProposer
from batchgen.engine.structured import GrammarConstraints
from batchgen.faults import Faults
from batchgen.model.llama import LlamaModel
from batchgen.model.loader import read_model_config
from batchgen.model.tokenizer import Tokenizer


class NativeEngine(Engine):
    name = "native"

    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] | None = None, *, model: LlamaModel | None = None, tokenizer=None,
                 faults: Faults | None = None, plan: EnginePlan | None = None):
        """`plan`: the weights and kernels to run (batchgen.engine.resolve.plan_engine; made from `config`
        where not given). `model` (with `tokenizer`): an already built model, e.g. random weights of a
        large shape for a benchmark (batchgen.model.random_init); then the plan is the model's.
        `faults`: requests that break the step, for the fault-injection tests (none by default)."""
        self.config = config
        self.faults = faults or Faults()
        self.model_dir = Path(model_dir)
        c = model.config if model is not None else read_model_config(model_dir)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(model_dir)
        self.clock = clock or monotonic_clock()
        self.constraints = GrammarConstraints(model_dir, c.vocab_size, sorted(c.eos_token_ids))
        self.runner = ModelRunner(model_dir, config, self.constraints, model=model, plan=plan)  # the device's side
        self.max_model_len = self.runner.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size,
                                   config.enable_prefix_caching and config.enable_kv_cache)
        self.proposer = (NgramProposer(config.speculative_ngram, config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.speculative_ngram and config.enable_kv_cache else None)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, self.max_model_len, config.max_num_batched_tokens,
                                   self.proposer, config.admission)
        self.output = OutputProcessor(self.scheduler, self.blocks, self.constraints, self.tokenizer,
                                      set(c.eos_token_ids), self.max_model_len,
                                      (self.runner.model.weight_bytes, self.runner.row_embed_bytes,
                                       self.runner.kv_bytes_per_token))
        self._ids: set[str] = set()
        # a thinking model's markers, from its own chat template and vocabulary (None: no reasoning)
        self.markers = markers_of(self.tokenizer.template_source, self.tokenizer.token_id, self.tokenizer.encode)

    # the runner's and the output processor's figures, where callers (bench, tests) read them
    model = property(lambda self: self.runner.model)
    dtype = property(lambda self: self.runner.dtype)
    plan = property(lambda self: self.runner.plan)
    kv_bytes_per_token = property(lambda self: self.runner.kv_bytes_per_token)
    compile_s = property(lambda self: self.runner.compile_s)
    num_draft_tokens = property(lambda self: self.output.num_draft_tokens)
    num_accepted_tokens = property(lambda self: self.output.num_accepted_tokens)

    @property
    def eos_token_ids(self) -> set[int]:
        return self.output.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.output.eos_token_ids = ids

    @property
    def num_computed_positions(self) -> int:
        """Positions run through the model (the lab's count)."""
        return self.runner.num_computed_positions

    @property
    def sample_seconds(self) -> float:
        """Seconds spent choosing tokens from logits so far (argmax or the sampler)."""
        return self.runner.sampler.seconds

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
            thought = (Thought(self.markers, self.markers.in_thought_after(prompt_token_ids),
                                    sampling.max_reasoning_tokens) if self.markers else None)
            # a grammar, logprobs or a reasoning budget go one token at a time: no drafts for them
            speculate = not sampling.structured and sampling.logprobs is None and sampling.max_reasoning_tokens is None
            self.scheduler.add(Request(request_id, list(prompt_token_ids), sampling, seed, enqueue_t=self.clock(),
                                       speculate=speculate, thought=thought))
        except ValueError as e:
            self.constraints.drop(request_id)
            raise RequestRejected(str(e)) from None
        self._ids.add(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block between runs of the same prompts (a benchmark's repeats), so
        that each run computes its prompts as a dataset job's first and only run does."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("the prefix cache is not emptied with requests in flight")
        self.blocks.reset_prefix_cache()

    def abort_all(self) -> list[str]:
        self._ids.clear()
        self.constraints.matchers.clear()
        return [r.request_id for r in self.scheduler.abort_all()]

    def step(self) -> StepResult:
        """schedule -> execute (the forward pass and the sampler: one host sync) -> postprocess"""
        start_t = self.clock()
        sched = self.scheduler.schedule()
        if self.faults.fail_requests:
            self.faults.fail_if_poisoned([c.request.request_id for c in sched.chunks])
        sampled, logprobs = self.runner.execute(sched.chunks)
        res = self.output.process(sched, sampled, logprobs, start_t, self.clock())
        self._ids.difference_update(f.request_id for f in res.finished)
        return res

    def close(self) -> None:
        """Give the KV pool back now (a process that builds another engine should not hold two)."""
        self.runner.kv = None

    def conditions(self) -> dict[str, Any]:
        c = self.config
        return {
            "engine": self.name, "engine_version": batchgen.__version__, "torch_version": torch.__version__,
            **self.runner.conditions(), "device": c.device, "torch_threads": torch.get_num_threads(),
            "max_num_seqs": c.max_num_seqs, "max_model_len": self.max_model_len,
            "kv_budget_tokens": self.blocks.num_blocks * self.blocks.block_size, "kv_block_size": self.blocks.block_size,
            "kv_num_blocks": self.blocks.num_blocks, "enable_prefix_caching": self.blocks.enable_prefix_caching,
            "max_num_batched_tokens": c.max_num_batched_tokens, "enable_kv_cache": c.enable_kv_cache,
            "admission": self.scheduler.admission,
            "speculative": ({"method": "ngram", "num_speculative_tokens": c.speculative_ngram,
                             "prompt_lookup_min": c.prompt_lookup_min, "prompt_lookup_max": c.prompt_lookup_max}
                            if self.proposer else None),
        }
