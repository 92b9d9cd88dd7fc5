"""Frozen, validated configuration, one dataclass per layer.

Constructors do no I/O; reading a model directory lives in `batchgen.model.loader`.
Pydantic is kept to the edges (CLI/YAML, flow parameters); these are plain dataclasses.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def batchgen_home() -> Path:
    """Where this machine's models, measured figures and compiled kernels are kept (BATCHGEN_HOME)."""
    return Path(os.environ.get("BATCHGEN_HOME", Path.home() / ".cache" / "batchgen"))

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
TOO_LONG_POLICIES = ("error", "truncate")
ENGINES = ("native", "vllm")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")
# float32's CPU matmul (batchgen.model.linear): batchgen's gemv kernel, oneDNN's, or the faster of the two
# at the run's batch band, measured once per machine (batchgen.engine.precision.resolve_fp32_kernel)
FP32_KERNELS = ("auto", "gemv", "onednn")
# how the native engine draws sampled tokens (batchgen.engine.sampler): the fused C++ kernel (CPU,
# built on this machine), the torch ops, or fused where it serves
SAMPLER_KERNELS = ("auto", "fused", "torch")
# the native engine's weight formats (batchgen.model.loader): the checkpoint's values in the run's dtype;
# int4 (PyTorch's int4 CPU kernel, bf16 activations); gguf (the model's GGUF blocks, Q4_1 / Q8_0, as they
# ship, in batchgen's qgemv kernel with float32 activations)
QUANTIZATIONS = ("none", "int4", "gguf")
MAX_LOGPROBS = 20  # top alternatives per token, as the OpenAI API allows


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family checkpoint (from its config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # qwen2 has q/k/v bias
    qk_norm: bool = False  # qwen3 RMS-normalises each head's q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # RoPE scaling (Llama 3.x "llama3", "linear"); factor 1 and "default" mean none
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int | None = None
    # Gemma 2: GeGLU, (1 + w) norms, sandwich norms, a scaled embedding, soft-capped logits
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w)
    sandwich_norms: bool = False  # also norms the attention's and the MLP's outputs
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (else head_dim's)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None  # keys within this many positions, on the layers listed
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require(self.model_type in SUPPORTED_ARCHITECTURES,
                 f"unsupported architecture {self.model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        _require(self.rope_type in ROPE_TYPES, f"unsupported rope_type {self.rope_type!r}")
        _require(self.hidden_act in ("silu", "gelu_pytorch_tanh"),
                 f"the native engine does not implement activation {self.hidden_act!r}; use --engine vllm")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> "ModelConfig":
        """Build from the dicts of an HF `config.json` (and optional `generation_config.json`)."""
        model_type = cfg.get("model_type", "?")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"the native engine does not implement architecture {model_type!r} "
                              f"({', '.join(archs) or 'no architectures field'}); it runs "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}. Use --engine vllm, which runs it")
        rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}  # older configs: rope_scaling
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"the native engine does not implement rope_type {rope_type!r} (it has "
                              f"{', '.join(ROPE_TYPES)}). Use --engine vllm, which runs it")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = cfg.get("layer_types")
        if not window:
            sliding: tuple[int, ...] = ()
        elif layer_types:
            sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        elif model_type == "gemma2":  # older configs: local attention on every other layer, from the first
            sliding = tuple(range(0, cfg["num_hidden_layers"], 2))
        else:  # Mistral-style: every layer
            sliding = tuple(range(cfg["num_hidden_layers"]))
        gemma = model_type == "gemma2"
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos: list[int] = []
        for src in (generation_cfg or {}, cfg):
            v = src.get("eos_token_id")
            if v is None:
                continue
            for e in v if isinstance(v, list) else [v]:
                if e not in eos:
                    eos.append(int(e))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id"),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position=rope.get("original_max_position_embeddings"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            norm_plus_one=gemma, sandwich_norms=gemma,
            embed_scale=float(cfg["hidden_size"]) ** 0.5 if gemma else 1.0,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            sliding_window=window if sliding else None, sliding_layers=sliding,
        )

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the chosen token's logprob; k: also the top k alternatives
    structured: str | None = None  # canonical response_format spec (batchgen.data.response_format), or None
    lora: str | None = None  # the name of a LoRA adapter of the run (vLLM engine)

    def __post_init__(self) -> None:
        _require(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
                 and math.isfinite(self.temperature) and self.temperature >= 0,
                 f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _require(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _require(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
                 f"seed must be an integer, got {self.seed!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


CPU_DEFAULT_KV_BYTES = 1 << 30  # on CPU, without a budget: 1 GiB of KV (vLLM's CPU backend takes a fixed space too)
CUDA_DEFAULT_KV_FRACTION = 0.9  # on CUDA: this fraction of the memory free once the weights are loaded


@dataclass(frozen=True)
class EngineConfig:
    """How the engine packs work: batch width, KV pool, precision and device."""

    max_num_seqs: int = 32
    max_model_len: int = 2048  # positions per sequence (prompt + output)
    kv_cache_memory_gib: float | None = None  # the KV pool's size
    kv_cache_memory_fraction: float | None = None  # or: this fraction of the device's free memory
    kv_cache_tokens: int | None = None  # or: a pool of this many token positions
    block_size: int = 16  # positions per KV block
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 4096  # tokens per step: decode tokens plus chunks of prompts
    dtype: str = "auto"  # auto: the fastest for this machine and max_num_seqs (batchgen.engine.precision)
    device: str = "cpu"
    enable_kv_cache: bool = True  # False recomputes the whole history every step (the lab)
    attention_backend: str = "auto"  # auto: FlashInfer on CUDA, the C++ kernel on CPU, where they load; else the PyTorch path
    speculative_ngram: int = 0  # draft tokens per step from n-gram prompt lookup (0: no speculation)
    prompt_lookup_min: int = 2  # shortest n-gram matched
    prompt_lookup_max: int = 4  # longest n-gram matched, tried first
    compile: str = "auto"  # torch.compile: on, off, auto (where it pays; see batchgen.engine.decode_graphs)
    pack_weights: bool = True  # weights in the kernel's fastest layout (False: the checkpoint's, for A/B)
    quantization: str = "none"  # weight format (QUANTIZATIONS): int4 (bf16 activations), gguf (the GGUF's blocks)
    # float32's CPU matmul: auto (batchgen's gemv kernel, built on this machine, where it builds; else
    # oneDNN), gemv, or onednn (FP32_KERNELS)
    fp32_kernel: str = "auto"
    sampler: str = "auto"  # auto (the fused C++ sampler on a CPU that builds it, else torch), fused or torch
    # decode-only steps padded to static (rows, pairs) buckets and replayed as CUDA graphs; auto: on CUDA
    # with the PyTorch paged attention; on CPU, `on` runs the same static buckets eagerly (no graphs there)
    cuda_graphs: str = "auto"
    seed: int = 0  # run-level seed; requests without their own seed derive one from it and their id

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(self.kv_cache_tokens is None or self.kv_cache_tokens >= 1,
                 f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        _require(self.kv_cache_memory_gib is None or self.kv_cache_memory_gib > 0,
                 f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        _require(self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 1,
                 f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        _require(sum(x is not None for x in (self.kv_cache_memory_gib, self.kv_cache_memory_fraction,
                                             self.kv_cache_tokens)) <= 1,
                 "give one KV pool size: kv_cache_memory, kv_cache_memory_fraction or kv_cache_tokens")
        _require(1 <= self.block_size <= 1024, f"block_size must be in [1, 1024], got {self.block_size}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                 f"({self.max_num_seqs}): every running sequence needs a token of each step's budget")
        _require(self.dtype in DTYPES + ("auto",), f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        _require(self.speculative_ngram >= 0, f"speculative_ngram must be >= 0, got {self.speculative_ngram}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                 f"{self.prompt_lookup_max}")
        _require(self.compile in ("auto", "on", "off"), f"compile must be auto, on or off, got {self.compile!r}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _require(self.fp32_kernel in FP32_KERNELS,
                 f"fp32_kernel must be one of {FP32_KERNELS}, got {self.fp32_kernel!r}")
        _require(self.sampler in SAMPLER_KERNELS, f"sampler must be one of {SAMPLER_KERNELS}, got {self.sampler!r}")
        _require(self.cuda_graphs in ("auto", "on", "off"), f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        _require(self.quantization != "gguf" or self.dtype in ("auto", "float32"),
                 f"quantization gguf multiplies its blocks with float32 activations: use dtype auto or float32, "
                 f"not {self.dtype!r}")
        _require(self.quantization != "int4" or self.dtype in ("auto", "bfloat16"),
                 f"quantization int4 runs its activations in bfloat16 (PyTorch's int4 CPU kernel; with float32 "
                 f"activations it takes a reference path measured 15x slower): use dtype auto or bfloat16, "
                 f"not {self.dtype!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")

    def kv_pool_bytes(self, bytes_per_token: int, free_bytes: int) -> int:
        """The KV pool's size in bytes; `free_bytes`: the device's free memory once the weights are in
        (used only for a fraction; without any budget, CPU takes a fixed 1 GiB and CUDA 90% of it)."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens * bytes_per_token
        if self.kv_cache_memory_gib is not None:
            return int(self.kv_cache_memory_gib * (1 << 30))
        if self.kv_cache_memory_fraction is None and not self.device.startswith("cuda"):
            return CPU_DEFAULT_KV_BYTES
        return int(free_bytes * (self.kv_cache_memory_fraction or CUDA_DEFAULT_KV_FRACTION))


@dataclass(frozen=True)
class RunConfig:
    """One generation job: where rows come from and go, and how they are generated."""

    inputs: tuple[str, ...]
    output_dir: str
    model: str = "smollm2-135m"
    engine: str = "native"
    run_id: str | None = None
    shard_size: int = 1000
    too_long: str = "error"  # what to do with a prompt longer than the context
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine_options: tuple[tuple[str, Any], ...] = ()  # backend-specific knobs (vllm), as sorted pairs
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()  # template variables for every row, as sorted pairs
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, local adapter dir) a row's lora column picks from
    keep_columns: tuple[str, ...] = ()  # input columns carried into requests/ and errors/
    n: int = 1  # samples per prompt (a row's n column wins)
    output_format: str = "parquet"  # or "openai-batch": also the Batch API's output and error JSONL files
    progress: bool = True

    def __post_init__(self) -> None:
        _require(len(self.inputs) > 0, "at least one input path is required")
        _require(self.output_format in ("parquet", "openai-batch"),
                 f"output_format must be parquet or openai-batch, got {self.output_format!r}")
        _require(self.engine in ENGINES, f"engine must be one of {ENGINES}, got {self.engine!r}")
        _require(self.shard_size >= 1, f"shard_size must be >= 1, got {self.shard_size}")
        _require(self.run_id is None or is_plain_name(self.run_id),
                 f"run_id {self.run_id!r} must be a plain directory name: no '/', not '.' or '..', "
                 f"not starting with '.' (the run must stay inside the output root)")
        _require(self.too_long in TOO_LONG_POLICIES, f"too_long must be one of {TOO_LONG_POLICIES}, got {self.too_long!r}")


def derive_seed(run_seed: int, request_id: str) -> int:
    """A request's seed when its row has none: stable across runs, processes, engines and batch
    composition, so the same run id gives the same samples on a re-run."""
    import hashlib

    digest = hashlib.blake2b(f"{run_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def is_plain_name(name: str) -> bool:
    """One directory name directly under its parent: nothing that climbs out or hides."""
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0")
