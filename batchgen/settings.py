"""The edge: user-facing settings (YAML config, CLI flags, flow parameters) validated with pydantic,
then turned into the library's frozen RunConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batchgen.config import ATTENTION_BACKENDS, QUANTIZATIONS, EngineConfig, RunConfig, SamplingParams
from batchgen.data.response_format import normalise_response_format


class GenerateSettings(BaseModel):
    """Settings of one generation job."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    input: list[str] = Field(..., min_length=1, title="Input",
                             description="Parquet or JSONL (rows, or OpenAI Batch request lines): file(s), "
                                         "directory or glob, local or a URI such as s3://bucket/prompts/")
    output: str = Field("runs", title="Output root",
                        description="each run is written to OUTPUT/RUN_ID/ (a local path or s3://bucket/prefix)")
    run_id: str | None = Field(None, title="Run id",
                               description="letters, digits, '.', '_', '-' (not starting with '.'); "
                                           "reuse an id to resume; a new one if empty",
                               pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")
    model: str = Field("smollm2-135m", title="Model", description="'smollm2-135m' or a local HF-format directory")
    engine: Literal["native", "vllm"] = Field("native", title="Engine",
                                                  description="native: batchgen's own paged engine (CPU or CUDA); "
                                                              "vllm: vLLM's engine (the cpu or gpu extra)")
    max_tokens: int = Field(128, ge=1, title="Max new tokens per row (a row's max_tokens column wins)",
                            description="generation stops at this many tokens unless EOS or a stop string "
                                        "comes first")
    temperature: float = Field(0.0, ge=0, title="Temperature (0 = greedy)",
                               description="0 picks the most likely token; above 0 samples, with each row's "
                                           "own seed (a row's temperature column wins)")
    top_p: float = Field(1.0, gt=0, le=1, title="Top-p",
                         description="sample from the smallest set of tokens holding this probability; 1: off")
    top_k: int = Field(0, ge=0, title="Top-k (0 = off)",
                       description="sample from the k most likely tokens only")
    seed: int = Field(0, title="Run seed", description="rows without a seed column derive theirs from it and their id")
    stop: list[str] = Field(default_factory=list, title="Stop strings",
                            description="generation ends before any of these (a row's stop column wins)")
    ignore_eos: bool = Field(False, title="Ignore EOS",
                             description="keep generating past end-of-sequence up to max tokens (benchmarks)")
    response_format: str | None = Field(None, title="Response format (JSON)",
                                        description='as in the OpenAI API, e.g. {"type": "json_schema", '
                                                    '"json_schema": {"schema": {...}}}; also regex and choice; '
                                                    "a row's response_format column wins")
    n: int = Field(1, ge=1, le=1024, title="Samples per prompt",
                   description="each sample is its own row in requests/ with sample_index (a row's n column wins)")
    logprobs: int | None = Field(None, ge=0, le=20, title="Logprobs",
                                 description="0: each output token's logprob in tokens/; k: also its top k "
                                             "alternatives; empty: none (a row's logprobs column wins)")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, title="Chat template variables",
                                                 description="e.g. enable_thinking=false; a row's "
                                                             "chat_template_kwargs column adds to them")
    keep_columns: list[str] = Field(default_factory=list, title="Input columns to keep",
                                    description="carried into requests/ and errors/, so outputs join back "
                                                "to their metadata")
    max_num_seqs: int = Field(32, ge=1, le=4096, title="Max sequences per decode batch",
                              description="rows decoded together in one step: wider is more throughput, "
                                          "longer per-token latency (the sweep deployment measures both)")
    max_model_len: int = Field(2048, ge=16, title="Max positions per sequence",
                               description="prompt plus generated tokens; longer prompts follow 'Prompts longer "
                                           "than the context'")
    kv_cache_memory: float | None = Field(None, gt=0, title="KV-cache memory (GiB)",
                                          description="the paged KV pool's size; default 1 GiB on CPU, "
                                                      "90% of the free GPU memory on CUDA")
    kv_cache_memory_fraction: float | None = Field(None, gt=0, le=1, title="KV-cache memory (fraction)",
                                                   description="or: this fraction of the device's free memory")
    kv_cache_tokens: int | None = Field(None, ge=1, title="KV-cache size (token positions)",
                                        description="or: a pool of this many token positions")
    block_size: int = Field(16, ge=1, le=1024, title="KV block size (positions)",
                            description="token positions per block of the paged KV pool")
    enable_prefix_caching: bool = Field(True, title="Prefix caching",
                                        description="reuse the KV of prompt prefixes that rows share")
    max_num_batched_tokens: int = Field(4096, ge=1, title="Max tokens per step",
                                        description="decode tokens plus chunks of prompts, in one forward pass")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", title="Dtype", description="auto: the weight dtype measured fastest on this machine for "
                                           "max_num_seqs (native engine; vLLM applies its own auto rule)")
    device: str = Field("cpu", title="Device", pattern=r"^(cpu|cuda(:\d+)?)$",
                        description="cpu, cuda or cuda:N")
    speculative_ngram: int = Field(0, ge=0, le=16, title="Speculative tokens (n-gram)",
                                   description="draft tokens per step copied from the row's own context "
                                               "(prompt lookup), verified in one pass; 0: off")
    quantization: Literal[QUANTIZATIONS] = Field(
        "none", title="Weight quantization (native engine)",
        description="int4: the layers' weights as 4-bit codes with a scale and zero per 32 (PyTorch's int4 CPU "
                    "kernel, bf16 activations): faster at small batches, slower at wide ones; gguf: the model's "
                    "GGUF blocks as they ship (Q4_1 layers and Q8_0 head for SmolLM2), multiplied exactly by "
                    "batchgen's low-bit kernel with float32 activations (CPU)")
    fp32_kernel: Literal["auto", "gemv", "onednn"] = Field(
        "auto", title="float32 CPU matmul (native engine)",
        description="gemv: batchgen's kernel, built once per machine for its vector instructions (needs a C++ "
                    "compiler); onednn: oneDNN's prepacked kernel; auto: the faster of the two at the batch band nearest "
                    "max_num_seqs, measured once per machine (oneDNN's where gemv does not build)")
    sampler: Literal["auto", "fused", "torch"] = Field(
        "auto", title="Sampler (native engine)",
        description="fused: temperature, top-k and top-p in one C++ call per step, built once per machine (needs a "
                    "C++ compiler; CPU); torch: the same rule as torch ops; auto: fused where it builds, else torch")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", title="CUDA graphs (native engine)",
        description="decode steps padded to static buckets and replayed as CUDA graphs; auto: on CUDA with the "
                    "PyTorch paged attention (on CPU, on runs the same buckets without graphs)")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", title="Compile the step (native engine)",
        description="torch.compile (Inductor): on CPU the whole decode step, once per (rows, pairs) bucket; on CUDA "
                    "the step's elementwise kernels. auto: on CUDA; on CPU a bucket compiles once its eager steps "
                    "have cost what a compile costs on this machine (long jobs compile, short ones do not)")
    attention_backend: Literal[ATTENTION_BACKENDS] = Field(
        "auto", title="Attention kernel (native engine)",
        description="auto: FlashInfer's paged kernel on CUDA where installed, batchgen's C++ paged kernel on CPU "
                    "where it builds, else the PyTorch path")
    shard_size: int = Field(1000, ge=1, title="Rows per shard",
                            description="the unit of commit and resume: a crash redoes at most one shard per worker")
    too_long: Literal["error", "truncate"] = Field("error", title="Prompts longer than the context",
                                                     description="error: the row goes to errors/; truncate: keep "
                                                                 "the prompt's end that fits")
    lora_adapters: dict[str, str] = Field(default_factory=dict, title="LoRA adapters (vLLM engine)",
                                          description="NAME=PATH of local PEFT adapter directories; a row's "
                                                      "lora column names the one it uses")
    vllm: dict[str, Any] = Field(default_factory=dict, title="vLLM engine options",
                                 description="tensor_parallel_size, gpu_memory_utilization, enable_prefix_caching, ...")
    output_format: Literal["parquet", "openai-batch"] = Field(
        "parquet", title="Output format", description="openai-batch: also batch_output.jsonl and "
                                                      "batch_errors.jsonl, as the OpenAI Batch API writes them "
                                                      "(Parquet stays the record)")
    progress: bool = Field(True, title="Progress bar", description="a tqdm bar on the worker's stderr")

    @field_validator("response_format")
    @classmethod
    def _valid_response_format(cls, v: str | None) -> str | None:
        normalise_response_format(v)  # a ValueError names what is wrong
        return v

    def to_run_config(self) -> RunConfig:
        return RunConfig(
            inputs=tuple(self.input), output_dir=self.output, model=self.model, engine=self.engine,
            run_id=self.run_id, shard_size=self.shard_size, too_long=self.too_long,
            engine_config=EngineConfig(max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                                       kv_cache_memory_gib=self.kv_cache_memory,
                                       kv_cache_memory_fraction=self.kv_cache_memory_fraction,
                                       kv_cache_tokens=self.kv_cache_tokens, block_size=self.block_size,
                                       enable_prefix_caching=self.enable_prefix_caching,
                                       max_num_batched_tokens=self.max_num_batched_tokens, dtype=self.dtype,
                                       device=self.device, seed=self.seed, attention_backend=self.attention_backend,
                                       compile=self.compile, speculative_ngram=self.speculative_ngram,
                                       quantization=self.quantization, cuda_graphs=self.cuda_graphs,
                                       fp32_kernel=self.fp32_kernel, sampler=self.sampler),
            sampling=SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                    top_k=self.top_k, stop=tuple(self.stop), ignore_eos=self.ignore_eos,
                                    logprobs=self.logprobs, structured=normalise_response_format(self.response_format)),
            engine_options=tuple(sorted(self.vllm.items())),
            chat_template_kwargs=tuple(sorted(self.chat_template_kwargs.items())),
            keep_columns=tuple(self.keep_columns), n=self.n, lora_adapters=tuple(sorted(self.lora_adapters.items())),
            output_format=self.output_format, progress=self.progress)


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a config must be a mapping of settings")
    if isinstance(data.get("input"), str):
        data["input"] = [data["input"]]
    return data
