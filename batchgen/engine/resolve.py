"""plan_engine: the settings and the probed machine, resolved once into the engine's EnginePlan.

Everything `auto` in the engine's settings is decided here and nowhere else: the weights and their
dtype (batchgen.engine.precision measures the candidates once per machine), float32's matmul
kernel, the attention backend, and whether the run is batch-invariant. The plan never depends on
the run's own `max_num_seqs` where it is batch-invariant: it weighs the candidates at the band of
INVARIANT_BATCH, so every batch size takes the same weights (and a resume that widens the batches
changes no token). With `--batch-invariant off` the user asked for the fastest kernels for their
batch, so the candidates are weighed at the band of `max_num_seqs`.

`--batch-invariant auto` (the default) runs without invariance where this machine cannot have it,
and says why on stderr before the run starts (batchgen.worker); `on` refuses such a plan (PlanError).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from batchgen.config import EngineConfig, ModelConfig
from batchgen.engine.attention import resolve_backend
from batchgen.engine.plan import INVARIANT_MATMULS, EnginePlan, PlanError
from batchgen.engine.precision import (INVARIANT_BATCH, decode_matrices, resolve_dtype, resolve_fp32_kernel,
                                       resolve_gguf, resolve_invariant_dtype)
from batchgen.model import activation, bgemm, ggml, rmsnorm, rope
from batchgen.model.linear import can_int4, can_pack, fp32_kernel
from batchgen.model.loader import DTYPES, read_model_config

INVARIANT_KERNELS = "batchgen's gemv (float32), bgemm (bfloat16) and qgemv (GGUF blocks) are batch-invariant"


def plan_engine(engine: str, model_dir: str | Path, config: EngineConfig, options: dict[str, Any] | None = None,
                started: EnginePlan | None = None) -> EnginePlan:
    """The plan for `engine` ("native" | "vllm") on the model in `model_dir` under `config` on this
    machine. `started`: the plan a run's first attempt recorded; a batch-invariant one pins `--dtype
    auto` to the weights it took, so a resume on a machine whose measurements moved changes no token.
    Raises PlanError where `--batch-invariant on` cannot hold here."""
    if engine == "vllm":
        return _plan_vllm(config, options or {})
    return _plan_native(config, model_dir, read_model_config(model_dir), started)


def can_be_batch_invariant(engine: str, config: EngineConfig) -> bool:
    """Whether plan_engine will give a batch-invariant plan, answered before any weights are measured
    or loaded (a run's identity: a batch-invariant run may resume with other batch shapes)."""
    if config.batch_invariant == "off":
        return False
    if engine == "vllm":
        return config.device.startswith("cuda")
    if _blockers(config, _attention(config)[0]):
        return False
    gemv = config.fp32_kernel != "onednn" and fp32_kernel(config.fp32_kernel, "cpu")[0] is not None
    if config.quantization == "gguf":
        return not isinstance(ggml.load(), str)
    bf16 = bgemm.load() is None
    return {"auto": gemv or bf16, "float32": gemv, "bfloat16": bf16}.get(config.dtype, False)


def check_invariance_possible(engine: str, config: EngineConfig) -> None:
    """`--batch-invariant on` where it cannot hold: refused before a run directory is made."""
    if config.batch_invariant == "on" and not can_be_batch_invariant(engine, config):
        why = (_vllm_invariance(config) if engine == "vllm"
               else "; ".join(_blockers(config, _attention(config)[0])) or "no batch-invariant kernel for these "
               f"weights builds here ({INVARIANT_KERNELS})")
        raise refusal(why)


def refusal(why: str) -> PlanError:
    return PlanError(f"--batch-invariant on: this run cannot be batch-invariant here ({why}); use "
                     f"--batch-invariant auto to run without it (it says so on stderr), or change what it names")


def plan_of_model(config: EngineConfig, model) -> EnginePlan:
    """The plan of an engine given an already built model (a benchmark's random weights): the model's
    dtype and kernels, the settings' attention."""
    attention, attention_why = _attention(config)
    kernels_ = model.matmul_kernels()
    matmul = next(iter(kernels_)) if len(kernels_) == 1 else "+".join(sorted(kernels_))
    dtype = str(model.dtype).removeprefix("torch.")
    return _finish(config, "native", dtype, "dense", matmul, attention,
                   {"dtype": "the model's", "matmul": "the model's", "attention": attention_why},
                   _blockers(config, attention), all(k in INVARIANT_MATMULS for k in kernels_))


# ---- the native engine -----------------------------------------------------------------------------

def _attention(config: EngineConfig) -> tuple[str, str]:
    if not config.enable_kv_cache:
        return "none", "no KV cache: the whole history recomputed every step (the lab's baseline)"
    return resolve_backend(config.device, config.attention_backend)


def _blockers(config: EngineConfig, attention: str) -> list[str]:
    """Why a native engine under `config` cannot be batch-invariant whatever weights it takes ([]: it can)."""
    if config.device != "cpu":
        return [f"the native engine has no batch-invariant kernels on {config.device}"]
    out = []
    if attention != "cpu":
        out.append(f"attention {attention} (batchgen's C++ paged kernel is the batch-invariant one)")
    if rmsnorm.load() is not None:
        out.append(f"torch's RMSNorm, whose row sums differ between the compiled and the eager step "
                   f"(batchgen's rmsnorm kernel: {rmsnorm.load()})")
    if rope.load() is not None:
        out.append(f"torch's RoPE in place of batchgen's rope kernel, which both steps call ({rope.load()})")
    if config.quantization == "int4":
        out.append("int4 weights on PyTorch's int4 kernel, whose row sums depend on the batch")
    if not config.pack_weights:
        out.append("the checkpoint's layout (pack_weights off) on torch's matmul")
    return out


def _plan_native(config: EngineConfig, model_dir, c: ModelConfig, started: EnginePlan | None) -> EnginePlan:
    attention, attention_why = _attention(config)
    blockers = _blockers(config, attention)
    invariant = config.batch_invariant != "off" and not blockers  # choose among the invariant kernels only
    batch = INVARIANT_BATCH if invariant else config.max_num_seqs
    pinned = ""
    if (invariant and started is not None and started.engine == "native" and started.batch_invariant
            and config.dtype == "auto" and config.quantization == "none"):
        config = replace(config, dtype=started.dtype, quantization=started.quantization)
        pinned = f"as the run's first attempt took ({started.describe()}); "
    cpu_packed = config.device == "cpu" and config.pack_weights
    bf16_isa = bgemm.isa() if invariant and bgemm.load() is None else None
    fp32, fp32_why = config.fp32_kernel, "as requested"
    if config.quantization == "int4":
        if not can_int4(config.device):
            raise ValueError(f"quantization int4 needs PyTorch's int4 CPU kernel; device {config.device!r} "
                             f"has none here (on CUDA, serve a quantized checkpoint with the vllm engine)")
        dtype, weights, matmul, why = "bfloat16", "int4", "int4", "int4 weights: the kernel's activations"
    elif config.quantization == "gguf":
        dtype, weights, matmul, why = "float32", "gguf", "qgemv", "gguf blocks: the kernel's activations"
    else:
        if config.dtype in ("auto", "float32") and cpu_packed:
            # float32's kernel for this band first: `--dtype auto` compares float32 on it
            fp32, fp32_why = resolve_fp32_kernel(config.fp32_kernel, config.device, batch, decode_matrices(c), invariant)
        width = fp32_kernel(fp32, config.device)[0] if fp32 == "gemv" else None
        chosen = (resolve_invariant_dtype(config.device, decode_matrices(c), width, bf16_isa)
                  if invariant and config.dtype == "auto" else None)
        dtype, why = chosen or resolve_dtype(config.dtype, config.device, batch, fp32)
        weights = "dense"
        if config.dtype == "auto" and cpu_packed:
            take, gguf_why = resolve_gguf(model_dir, c, dtype, width if dtype == "float32" else None, batch,
                                          bf16_tiles=bf16_isa is not None)
            if take:
                why = f"auto: the model's GGUF blocks (float32 activations), {gguf_why}; dense: {dtype}, {why}"
                dtype, weights = "float32", "gguf"
            else:
                why = f"{why}; the model's GGUF blocks not taken: {gguf_why}"
        matmul = "qgemv" if weights == "gguf" else _dense_matmul(config, dtype, width, bf16_isa)
    whys = {"dtype": pinned + why, "matmul": fp32_why if matmul in ("gemv", "onednn") else matmul,
            "attention": attention_why}
    return _finish(config, "native", dtype, weights, matmul, attention, whys, blockers, matmul in INVARIANT_MATMULS)


def _dense_matmul(config: EngineConfig, dtype: str, width: int | None, bf16_isa: str | None) -> str:
    if config.device != "cpu" or not config.pack_weights:
        return "torch"  # cuBLAS on CUDA; the checkpoint's layout on CPU
    if dtype == "float32" and width is not None:
        return "gemv"
    if dtype == "bfloat16" and bf16_isa is not None:
        return "bgemm"
    return "onednn" if can_pack(DTYPES[dtype], "cpu") else "torch"


def _finish(config: EngineConfig, engine: str, dtype: str, weights: str, matmul: str, attention: str,
            whys: dict[str, str], blockers: list[str], invariant_matmul: bool) -> EnginePlan:
    """The plan, with whether it is batch-invariant and why; PlanError where `on` was asked and it is not."""
    if not invariant_matmul:
        blockers = blockers + [f"{dtype} weights on {matmul}, whose row sums depend on the batch ({INVARIANT_KERNELS})"]
    if config.batch_invariant == "off":
        invariant, why = False, "as asked (the fastest kernels for max_num_seqs' batch band)"
    elif blockers:
        invariant, why = False, "; ".join(blockers)
    else:
        matmuls = {"qgemv": "GGUF blocks on qgemv"}.get(matmul, f"{dtype} on {matmul}")
        att = f" ({torch.ops.batchgen_attention.bf16_isa()})" if dtype == "bfloat16" else ""
        act = ", one-pass SwiGLU" if activation.load() is None else ""
        invariant, why = True, (f"{matmuls}, C++ paged attention{att}, fixed-order RMSNorm and RoPE{act}, "
                                f"counter-hash sampling")
    if config.batch_invariant == "on" and not invariant:
        raise refusal(why)
    return EnginePlan(engine, config.device, dtype, weights, matmul, attention, invariant,
                      {**whys, "batch_invariant": why})


# ---- vLLM ------------------------------------------------------------------------------------------

def _vllm_invariance(config: EngineConfig) -> str:
    if config.batch_invariant == "off":
        return "as asked"
    if not config.device.startswith("cuda"):
        return "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) is for CUDA; none on CPU"
    return "vLLM's VLLM_BATCH_INVARIANT=1 (its batch-invariant kernels)"


def _plan_vllm(config: EngineConfig, options: dict[str, Any]) -> EnginePlan:
    """vLLM decides its own kernels; the plan names what batchgen asks of it. `dtype` "auto" stays
    vLLM's rule until its engine reports the dtype it took (batchgen.engine.vllm)."""
    if config.quantization != "none":  # vLLM quantizes through its own options and checkpoints
        raise ValueError(f"quantization {config.quantization!r} is the native engine's; with vllm, pass a "
                         f"quantized checkpoint or vllm options (e.g. quantization=...)")
    invariant = config.batch_invariant != "off" and config.device.startswith("cuda")
    why = _vllm_invariance(config)
    if config.batch_invariant == "on" and not invariant:
        raise refusal(why)
    return EnginePlan("vllm", config.device, config.dtype, options.get("quantization") or "dense", "vllm", "vllm",
                      invariant, {"dtype": "as requested" if config.dtype != "auto" else "auto: vLLM's rule",
                                  "batch_invariant": why})
