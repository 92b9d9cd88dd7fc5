"""VllmEngine: drives vLLM V1's LLMEngine step by step and times every token itself.

vLLM's offline `LLM.generate` returns no per-token times, so this engine adds requests with DELTA
outputs and calls `step()` in a loop: each RequestOutput carries that step's new tokens, stamped
with the step's time. Scheduler counts come from a stat logger plugged into the engine.
vllm is imported only when this engine is created (`import batchgen` stays light).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import batchgen
from batchgen.config import DTYPE_BYTES, EngineConfig, SamplingParams, kv_bytes_per_token
from batchgen.engine.base import (Engine, EngineDead, FinishedRequest, RequestRejected, StepResult, monotonic_clock,
                                  step_bytes_read)
from batchgen.engine.kv_cache import free_memory_bytes
from batchgen.engine.plan import EnginePlan
from batchgen.engine.reasoning import Thought, markers_of
from batchgen.engine.repetition import looping
from batchgen.engine.resolve import plan_engine
from batchgen.model.loader import count_decode_weight_elements, read_hf_shape
from batchgen.model.tokenizer import Tokenizer

# vllm.EngineArgs fields that batchgen sets itself, and the setting that sets each
OWNED = {"model": "--model", "tokenizer": "--model", "seed": "--seed (per row: the seed column)",
         "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len", "dtype": "--dtype",
         "disable_log_stats": "(batchgen reads vLLM's stats for steps/)"}


def check_vllm_options(options: dict[str, Any]) -> None:
    """Every vllm.EngineArgs field passes through; unknown keys and keys batchgen owns are refused
    with a line that says what to use instead."""
    import dataclasses
    import difflib

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    problems = []
    for key in sorted(options):
        if key in OWNED:
            problems.append(f"{key!r} is set by batchgen: use {OWNED[key]}")
        elif key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3, cutoff=0.6)
            problems.append(f"{key!r} is not a vllm EngineArgs field"
                            + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""))
    if problems:
        raise ValueError("vllm options: " + "; ".join(problems))
IDLE_TIMEOUT_S = 600.0  # no output at all for this long, with requests in flight, means a wedged engine


class EngineDied(EngineDead):
    """The vLLM engine can no longer make progress."""


@contextlib.contextmanager
def child_output(tail: collections.deque, fds: tuple[int, ...] = (1, 2)):
    """While vLLM starts its engine-core and worker processes, their stdout and stderr (inherited file
    descriptors) become pipes that a daemon thread copies to the terminal, keeping the last lines in
    `tail`. They print the real error there (vLLM logs to stdout); the parent only gets "EngineCore
    encountered an issue. See stack trace (above) for the root cause." This process's own descriptors
    are restored on exit; the children keep writing through the pipes for their lifetime."""
    saved = []
    for fd in fds:
        (sys.stdout if fd == 1 else sys.stderr).flush()
        read_end, write_end = os.pipe()
        terminal = os.dup(fd)
        os.dup2(write_end, fd)
        os.close(write_end)
        saved.append((fd, terminal))

        def pump(read_end=read_end, terminal=terminal) -> None:
            with os.fdopen(read_end, "rb") as src:
                for line in src:
                    os.write(terminal, line)
                    tail.append(line.decode(errors="replace").rstrip())
            os.close(terminal)

        threading.Thread(target=pump, name=f"batchgen-vllm-fd{fd}", daemon=True).start()
    try:
        yield tail
    finally:
        for fd, terminal in saved:
            (sys.stdout if fd == 1 else sys.stderr).flush()
            os.dup2(terminal, fd)  # this process writes to the terminal again


POINTERS = ("root cause", "stack trace", "initialization failed", "encountered an issue")
CAUSE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception|Exit)): (.+)")


def root_cause(lines) -> str | None:
    """The last "SomeError: message" the engine's processes printed that is not one of vLLM's pointers
    to it ("see the stack trace above"), or None."""
    time.sleep(0.2)  # the pumps copy what the failing processes wrote last
    for line in reversed(list(lines)):
        m = CAUSE.search(line)
        if m and not any(p in m.group(2).lower() for p in POINTERS):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
    return None


class _StepStats:
    """What vLLM's scheduler reported for the last step (filled in by a stat logger)."""

    def __init__(self):
        self.num_running = 0
        self.num_waiting = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preempted = 0
        self.prefix_queries = 0  # tokens looked up in vLLM's prefix cache
        self.prefix_hits = 0
        self.kv_usage = None  # fraction of the KV pool in use
        self.num_draft_tokens = 0  # speculative decoding: drafted, and accepted by the target model
        self.num_accepted_tokens = 0


def _stat_logger_factory(holder: _StepStats):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                holder.num_running = scheduler_stats.num_running_reqs
                holder.num_waiting = scheduler_stats.num_waiting_reqs
                holder.kv_usage = getattr(scheduler_stats, "kv_cache_usage", None)
                prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
                if prefix is not None:
                    holder.prefix_queries += getattr(prefix, "queries", 0)
                    holder.prefix_hits += getattr(prefix, "hits", 0)
                spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                if spec is not None:
                    holder.num_draft_tokens += spec.num_draft_tokens
                    holder.num_accepted_tokens += spec.num_accepted_tokens
            if iteration_stats is not None:
                holder.num_prompt_tokens += iteration_stats.num_prompt_tokens
                holder.num_generation_tokens += iteration_stats.num_generation_tokens
                holder.num_preempted += getattr(iteration_stats, "num_preempted_reqs", 0)

        def log_engine_initialized(self):
            pass

    return Recorder


def _lora_rank(adapter_dir: str) -> int:
    """vLLM's max_lora_rank for a PEFT adapter: its rank r (adapter_config.json), rounded up to a
    rank vLLM accepts."""
    cfg = Path(adapter_dir) / "adapter_config.json"
    if not cfg.is_file():
        raise ValueError(f"LoRA adapter {adapter_dir}: no adapter_config.json (a PEFT adapter directory is expected)")
    r = int(json.loads(cfg.read_text()).get("r", 16))
    return next((x for x in (1, 8, 16, 32, 64, 128, 256, 320, 512) if x >= r), r)


def _logprobs(entry, tok: int, k: int | None) -> tuple[float | None, list[tuple[int, float]] | None]:
    """vLLM's {token_id: Logprob(logprob, rank)} for one token -> (chosen logprob, top k by rank)."""
    if entry is None or k is None:
        return None, None
    chosen = entry[tok].logprob if tok in entry else None
    if not k:
        return chosen, None
    ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k))
    return chosen, [(tid, lp) for _, tid, lp in ranked[:k]]


VLLM_CPU_BLOCK = 128  # positions in a block of vLLM's CPU KV cache


class _Tracked:
    __slots__ = ("prompt_tokens", "token_ids", "text", "enqueue_t", "schedule_t", "first_token_t", "last_token_t",
                 "logprobs", "repetition_stop", "thought")

    def __init__(self, prompt_tokens: int, enqueue_t: float, logprobs: int | None = None,
                 repetition_stop: bool = False, thought: Thought | None = None):
        self.logprobs = logprobs
        self.repetition_stop = repetition_stop
        self.thought = thought
        self.prompt_tokens = prompt_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.enqueue_t = enqueue_t
        self.schedule_t: float | None = None
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] | None = None, options: dict[str, Any] | None = None,
                 lora_adapters: dict[str, str] | None = None, plan: EnginePlan | None = None):
        """`plan`: batchgen.engine.resolve.plan_engine's for vllm (made here where not given)."""
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        options = dict(options or {})
        check_vllm_options(options)
        plan = plan or plan_engine("vllm", model_dir, config, options)
        self.config = config
        self.model_dir = Path(model_dir)
        shape = read_hf_shape(model_dir)  # vLLM itself decides whether it runs the architecture
        self.max_model_len = min(config.max_model_len, shape["max_position_embeddings"])
        self.tokenizer = Tokenizer(model_dir)
        self.markers = markers_of(self.tokenizer.template_source, self.tokenizer.token_id, self.tokenizer.encode)
        self.clock = clock or monotonic_clock()
        on_cpu = config.device == "cpu"
        if plan.batch_invariant:  # vLLM reads it from the environment, in its engine process too
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        # enforce_eager stays vLLM's default (off: its compiled CPU path), as LLM(...) users get it
        options.setdefault("max_num_batched_tokens", max(config.max_num_batched_tokens, self.max_model_len))
        if on_cpu:
            # whole prompts a step (the budget above holds any one): vLLM 0.32 rewinds a seeded row's generator
            # for the token a partial prefill discards by CUDA's Philox offset (gen.set_offset(gen.get_offset()
            # - 4)), and torch's CPU generator has none: a sampled, seeded row prefilled in chunks killed the
            # engine core ("CPU Generator does not use offset")
            options.setdefault("enable_chunked_prefill", False)
        bpe = DTYPE_BYTES.get(config.dtype) or (4 if shape.get("torch_dtype") == "float32" else 2)  # auto: vLLM's rule
        self.kv_bytes_per_token = kv_bytes_per_token(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], bpe)
        # the same KV memory as the native engine: an explicit budget, or (CPU) the same fixed default;
        # on CUDA without a budget, vLLM's own gpu_memory_utilization sizes it
        explicit = config.kv_cache_memory is not None or config.kv_cache_tokens is not None
        if explicit or on_cpu:
            free = free_memory_bytes(config.device) if on_cpu else 0
            block = VLLM_CPU_BLOCK if on_cpu else 16  # vLLM's own block sizes on CPU and CUDA
            blocks = config.kv_blocks(self.kv_bytes_per_token, block, self.max_model_len, free)
            options.setdefault("kv_cache_memory_bytes", blocks * block * self.kv_bytes_per_token)
        if config.kv_cache_memory_fraction is not None and not on_cpu:
            options.setdefault("gpu_memory_utilization", config.kv_cache_memory_fraction)
        elif on_cpu:
            options.setdefault("gpu_memory_utilization", 0.5)
        options.setdefault("enable_prefix_caching", config.enable_prefix_caching)
        if config.speculative_ngram:  # the same flag as the native engine's: vLLM's ngram method
            options.setdefault("speculative_config", {
                "method": "ngram", "num_speculative_tokens": config.speculative_ngram,
                "prompt_lookup_min": config.prompt_lookup_min, "prompt_lookup_max": config.prompt_lookup_max})
        if "structured_outputs_config" not in options:  # the native engine's grammar library and whitespace rule
            from vllm.config import StructuredOutputsConfig

            options["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar",
                                                                           disable_any_whitespace=True)
        elif isinstance(options["structured_outputs_config"], dict):
            from vllm.config import StructuredOutputsConfig

            options["structured_outputs_config"] = StructuredOutputsConfig(**options["structured_outputs_config"])
        if self.markers is not None and "reasoning_config" not in options:  # what thinking_token_budget needs
            from vllm.config.reasoning import ReasoningConfig

            options["reasoning_config"] = ReasoningConfig(reasoning_start_str=self.markers.start,
                                                          reasoning_end_str=self.markers.end)
        self.lora_adapters = dict(lora_adapters or {})
        if self.lora_adapters:  # vLLM serves every adapter of the run, each row picks one
            options.setdefault("enable_lora", True)
            options.setdefault("max_loras", len(self.lora_adapters))
            options.setdefault("max_lora_rank", max(_lora_rank(p) for p in self.lora_adapters.values()))
        self.options = options
        self._stats = _StepStats()
        args = EngineArgs(model=str(model_dir), tokenizer=str(model_dir), dtype=config.dtype,
                          max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len, seed=config.seed,
                          disable_log_stats=False, **options)
        self._child_output: collections.deque[str] = collections.deque(maxlen=400)
        with child_output(self._child_output):  # the engine's processes report why they fail there, not to us
            try:
                self.engine = LLMEngine.from_engine_args(args, usage_context=UsageContext.LLM_CLASS,  # LLM(...)'s
                                                         stat_loggers=[_stat_logger_factory(self._stats)])
            except Exception as e:
                raise self._died("vLLM's engine did not start", f"{type(e).__name__}: {e}") from e
        resolved = getattr(getattr(self.engine, "model_config", None), "dtype", None)
        # the dtype vLLM's own rule took for `auto`
        self.plan = replace(plan, dtype=str(resolved).removeprefix("torch.") if resolved is not None else config.dtype)
        self._closing = False
        self._watch_engine_core()
        self.weight_bytes = count_decode_weight_elements(model_dir) * bpe
        self.row_embed_bytes = shape["hidden_size"] * bpe
        self._requests: dict[str, _Tracked] = {}
        self._step_id = 0
        import vllm

        self._vllm_version = vllm.__version__

    def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if request_id in self._requests:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        structured = None
        if sampling.structured:  # the same spec, through vLLM's own structured outputs
            from vllm.sampling_params import StructuredOutputsParams

            spec = json.loads(sampling.structured)
            structured = StructuredOutputsParams(json=spec.get("json"), regex=spec.get("regex"),
                                                 choice=spec.get("choice"), json_object=spec.get("json_object"),
                                                 disable_any_whitespace=True)
        params = VllmSamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                                    stop=list(sampling.stop) or None, ignore_eos=sampling.ignore_eos,
                                    logprobs=sampling.logprobs, structured_outputs=structured,
                                    output_kind=RequestOutputKind.DELTA, skip_special_tokens=True,
                                    # vLLM closes the thought itself (its reasoning_config, set from the markers)
                                    thinking_token_budget=sampling.max_reasoning_tokens if self.markers else None)
        if self._core_dead():  # vLLM would block forever on a call to a dead core
            raise self._died("vLLM's engine core died; the shard fails and is redone on retry or resume")
        lora = None
        if sampling.lora:
            if sampling.lora not in self.lora_adapters:
                raise RequestRejected(f"lora {sampling.lora!r} is not an adapter of this run")
            from vllm.lora.request import LoRARequest

            names = sorted(self.lora_adapters)
            lora = LoRARequest(sampling.lora, names.index(sampling.lora) + 1, self.lora_adapters[sampling.lora])
        enqueue_t = self.clock()
        try:
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params,
                                    lora_request=lora)
        except Exception as e:  # noqa: BLE001 - vLLM's per-request validation has several exception types
            if "Dead" in type(e).__name__:  # EngineDeadError: the shard fails and is retried, not a row error
                raise
            raise RequestRejected(f"vllm rejected the request: {e}") from None
        thought = (Thought(self.markers, self.markers.in_thought_after(prompt_token_ids), sampling.max_reasoning_tokens)
                   if self.markers else None)  # only watched here: vLLM writes the close where the budget ends
        self._requests[request_id] = _Tracked(len(prompt_token_ids), enqueue_t, sampling.logprobs,
                                              sampling.stops_loops, thought)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _watch_engine_core(self) -> None:
        """If the engine-core process exits, wake a step() blocked on its output queue with an error.
        (vLLM's own monitor can stall in its cleanup, leaving the caller blocked forever.)"""
        from multiprocessing.connection import wait

        core = self.engine.engine_core
        resources = getattr(core, "resources", None)
        procs = getattr(getattr(resources, "engine_manager", None), "processes", None)
        queue = getattr(core, "outputs_queue", None)
        if not procs or queue is None:
            return  # in-process engine core: nothing to watch

        def watch() -> None:
            wait([p.sentinel for p in procs])
            if not self._closing:
                resources.engine_dead = True
                queue.put_nowait(EngineDied("vLLM's engine core process exited"))

        threading.Thread(target=watch, name="batchgen-vllm-watchdog", daemon=True).start()

    def _core_dead(self) -> bool:
        # the client's liveness flag (set by the monitors), or a core process seen dead right now
        resources = getattr(self.engine.engine_core, "resources", None)
        procs = getattr(getattr(resources, "engine_manager", None), "processes", None) or []
        return bool(getattr(resources, "engine_dead", False)) or any(not p.is_alive() for p in procs)

    def step(self) -> StepResult:
        stats = self._stats
        prompt_before, gen_before = stats.num_prompt_tokens, stats.num_generation_tokens
        before = (stats.num_preempted, stats.prefix_queries, stats.prefix_hits, stats.num_draft_tokens,
                  stats.num_accepted_tokens)
        start_t = self.clock()
        if self._core_dead():
            raise self._died("vLLM's engine core died; the shard fails and is redone on retry or resume")
        outputs = self._engine_step()
        idle_since = time.monotonic()
        while not outputs and self.engine.has_unfinished_requests():  # an idle poll is not a step
            if self._core_dead():
                raise self._died("vLLM's engine core died; the shard fails and is redone on retry or resume")
            if time.monotonic() - idle_since > IDLE_TIMEOUT_S:
                raise EngineDied(f"vLLM produced no output for {IDLE_TIMEOUT_S:.0f} s with requests in flight")
            outputs = self._engine_step()
        end_t = self.clock()
        now_mono = time.monotonic()
        self._step_id += 1
        res = StepResult(step_id=self._step_id, start_t=start_t, end_t=end_t, num_running=0, num_waiting=0,
                         num_prefill_tokens=stats.num_prompt_tokens - prompt_before, num_decode_tokens=0,
                         sum_context_len=0, bytes_read=0)
        looped = []
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:  # a row this engine ended (a loop) whose abort vLLM had not yet seen
                continue
            completion = out.outputs[0]
            new_ids = list(completion.token_ids)
            if tracked.schedule_t is None:  # the engine core's scheduling time: same monotonic clock as ours
                sched_ts = getattr(getattr(out, "metrics", None), "scheduled_ts", 0.0) or 0.0
                tracked.schedule_t = (max(end_t - (now_mono - sched_ts), tracked.enqueue_t)
                                      if 0 < sched_ts <= now_mono else start_t)
            step_lps = completion.logprobs if tracked.logprobs is not None else None
            for j, tok in enumerate(new_ids):
                ctx = tracked.prompt_tokens + len(tracked.token_ids)
                res.token_request_ids.append(out.request_id)
                res.token_indices.append(len(tracked.token_ids))
                res.token_context_lens.append(ctx)
                chosen, top = _logprobs(step_lps[j] if step_lps else None, tok, tracked.logprobs)
                res.token_logprobs.append(chosen)
                res.token_top_logprobs.append(top)
                res.sum_context_len += ctx
                if tracked.thought is not None:
                    tracked.thought.took(tok, len(tracked.token_ids))
                tracked.token_ids.append(tok)
            if new_ids:  # like the native engine: the time step() returned, after the device synced
                tracked.first_token_t = tracked.first_token_t if tracked.first_token_t is not None else end_t
                tracked.last_token_t = end_t
            tracked.text += completion.text
            reason = ("stop" if completion.finish_reason == "stop" else "length") if out.finished else None
            if reason is None and tracked.repetition_stop and looping(tracked.token_ids):
                reason = "repetition"  # the native engine's rule (batchgen.engine.repetition), vLLM told to drop it
                looped.append(out.request_id)
            if reason is not None:
                del self._requests[out.request_id]
                thought = tracked.thought
                reasoning, text, n = (thought.split(tracked.token_ids, self.tokenizer.decode) if thought
                                      else (None, tracked.text, 0))
                if reasoning is None:
                    text = tracked.text  # vLLM's own detokenized text where there is no thought to split
                res.finished.append(FinishedRequest(
                    out.request_id, tracked.prompt_tokens, tracked.token_ids, text, reason, tracked.enqueue_t,
                    min(tracked.schedule_t, tracked.first_token_t or end_t), tracked.first_token_t or end_t,
                    tracked.last_token_t or end_t, num_cached_tokens=getattr(out, "num_cached_tokens", None),
                    reasoning=reasoning, reasoning_tokens=n if reasoning is not None else None,
                    reasoning_cut=thought.cut if reasoning is not None else None))
        if looped:
            self.engine.abort_request(looped)
        num_tokens = len(res.token_request_ids)
        res.num_running = stats.num_running or len({r for r in res.token_request_ids})
        res.num_waiting = stats.num_waiting
        res.num_decode_tokens = max(stats.num_generation_tokens - gen_before, 0)
        res.num_preempted = stats.num_preempted - before[0]
        res.num_lookup_tokens = stats.prefix_queries - before[1]
        res.num_cached_tokens = stats.prefix_hits - before[2]
        res.num_draft_tokens = stats.num_draft_tokens - before[3]
        res.num_accepted_tokens = stats.num_accepted_tokens - before[4]
        res.bytes_read = step_bytes_read(bool(num_tokens or res.num_prefill_tokens), num_tokens, res.sum_context_len,
                                         self.weight_bytes, self.row_embed_bytes, self.kv_bytes_per_token)
        return res

    def _engine_step(self):
        try:
            return self.engine.step()
        except EngineDead as e:  # the watchdog's
            raise self._died(str(e)) from e
        except Exception as e:  # vLLM's EngineDeadError fails the shard; anything else may be one request's
            if "Dead" in type(e).__name__:
                raise self._died("vLLM's engine core died", str(e)) from e
            raise

    def _died(self, what: str, detail: str | None = None) -> EngineDied:
        """The error for a dead engine, ending with the cause its processes printed where they did (else
        with what vLLM told this process)."""
        cause = root_cause(self._child_output)
        return EngineDied(f"{what}: {cause}" if cause else f"{what} ({detail})" if detail else what)

    def abort_all(self) -> list[str]:
        ids = list(self._requests)
        if ids and not self._core_dead():
            self.engine.abort_request(ids)
        self._requests.clear()
        return ids

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache between runs of the same prompts (a benchmark's repeats), so that each
        run computes its prompts as a dataset job's first and only run does."""
        if self._requests:
            raise RuntimeError(f"vLLM's prefix cache is not emptied with {len(self._requests)} requests in flight")
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache (reset_prefix_cache returned False)")

    def conditions(self) -> dict[str, Any]:
        c = self.config
        return {
            "engine": self.name, "engine_version": self._vllm_version, "batchgen_version": batchgen.__version__,
            "plan": self.plan.fields(), "dtype": self.plan.dtype, "dtype_choice": self.plan.why["dtype"],
            "quantization": self.options.get("quantization"), "device": c.device,
            "max_num_seqs": c.max_num_seqs, "max_model_len": self.max_model_len,
            "kv_budget_tokens": (self.options["kv_cache_memory_bytes"] // self.kv_bytes_per_token
                                 if "kv_cache_memory_bytes" in self.options else None),
            "enable_prefix_caching": self.options.get("enable_prefix_caching"),
            "max_num_batched_tokens": self.options["max_num_batched_tokens"],
            "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "speculative": self.options.get("speculative_config"), "vllm_options": self.options,
            "lora_adapters": self.lora_adapters, "batch_invariant": self.plan.invariance(),
        }

    def close(self) -> None:
        self._closing = True
        engine = getattr(self, "engine", None)
        if engine is not None:
            shutdown = getattr(engine.engine_core, "shutdown", None)
            if shutdown:
                shutdown()
            self.engine = None
