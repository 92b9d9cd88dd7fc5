"""Local HF-format directory -> ModelConfig + fused weights. No hub access, ever."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from batchgen.config import DTYPES as RUN_DTYPES
from batchgen.config import QUANTIZATIONS, ConfigError, ModelConfig
from batchgen.model import ggml
from batchgen.model.ggml import BLOCK_BYTES, BlockLinear, GGUFBlocks, GGUFError
from batchgen.model.linear import Int4Linear, Linear
from batchgen.model.linear import fp32_kernel as fp32_kernel_for
from batchgen.model.llama import Layer, LlamaModel

DTYPES = {name: getattr(torch, name) for name in RUN_DTYPES}  # batchgen.config's names, as torch dtypes


class ModelLoadError(RuntimeError):
    """The model directory is missing a file or holds something we cannot run."""


def read_model_config(model_dir: str | Path) -> ModelConfig:
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if not d.is_dir():
        raise ModelLoadError(f"model directory not found: {d}")
    if not cfg_path.is_file():
        raise ModelLoadError(f"missing config.json in model directory {d}")
    cfg = json.loads(cfg_path.read_text())
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    try:
        return ModelConfig.from_hf_config(cfg, gen)
    except ConfigError as e:
        raise ModelLoadError(f"{cfg_path}: {e}") from None
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: missing field {e.args[0]!r}") from None


def read_hf_shape(model_dir: str | Path) -> dict[str, Any]:
    """The few shape figures any engine's bookkeeping needs (KV bytes per token, context length),
    read leniently from config.json for any architecture: no support check, which is the engine's."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ModelLoadError(f"missing config.json in model directory {d}")
    cfg = json.loads((d / "config.json").read_text())
    text = {**cfg, **(cfg.get("text_config") or {})}  # multimodal configs nest the language model's
    heads = text.get("num_attention_heads", 1)
    hidden = text.get("hidden_size", 0)
    return {"num_layers": text.get("num_hidden_layers", 0), "num_kv_heads": text.get("num_key_value_heads") or heads,
            "head_dim": text.get("head_dim") or (hidden // heads if heads else 0), "hidden_size": hidden,
            "max_position_embeddings": text.get("max_position_embeddings", 2048),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            "torch_dtype": text.get("torch_dtype") or text.get("dtype")}


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
    else:
        files = sorted(d.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ModelLoadError(f"missing weights in {d}: expected model.safetensors (or shards) {missing or ''}".rstrip())
    return files


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(model_dir)):
        state.update(load_file(str(f)))
    return state


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu",
               max_positions: int | None = None, pack_weights: bool = True, quantization: str = "none",
               fp32_kernel: str = "auto", bf16_tiles: bool = False) -> LlamaModel:
    """Load a local Llama-family checkpoint, fusing q/k/v and gate/up for fewer, larger matmuls, each
    in the layout fastest for the device's kernel (`pack_weights=False` keeps the checkpoint's).
    `quantization="int4"`: the layers' matrices as 4-bit weights (batchgen.model.linear.Int4Linear),
    quantized from the checkpoint's own values; the head and norms stay in `dtype`.
    `quantization="gguf"`: every matrix the model's GGUF holds in Q4_1 or Q8_0 blocks is multiplied in
    those blocks (batchgen.model.ggml, float32 activations); the norms and the embedding's lookups
    come from the safetensors. `fp32_kernel`: float32's CPU matmul kernel (batchgen.config.FP32_KERNELS).
    `bf16_tiles`: bfloat16 matrices on batchgen's batch-invariant bgemm kernel (the caller has checked
    that it loads here, batchgen.model.bgemm) instead of oneDNN's."""
    config = read_model_config(model_dir)
    state = load_state_dict(model_dir)
    dt = DTYPES[dtype]
    int4 = quantization == "int4"
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}: one of {', '.join(QUANTIZATIONS)}")
    blocks = _gguf_blocks(model_dir, config, device, dt) if quantization == "gguf" else None

    def take(name: str, required: bool = True, as_dtype: torch.dtype | None = None):
        t = state.pop(name, None)
        if t is None and required:
            raise ModelLoadError(f"{model_dir}: weight {name!r} not found in safetensors")
        return None if t is None else t.to(device=device, dtype=as_dtype or dt).contiguous()

    def matrix(name: str):  # int4 quantizes from the checkpoint's float32 values, not a bf16 rounding of them
        return take(name, as_dtype=torch.float32 if int4 else None)

    def norm(name: str):  # Gemma's RMSNorm scales by (1 + w): fold the 1 in once, at load
        w = take(name)
        return w + 1 if config.norm_plus_one else w

    width, why = fp32_kernel_for(fp32_kernel, device) if pack_weights and dt == torch.float32 else (None, None)

    def linear(w, bias=None) -> Linear:
        return Linear(w, bias, pack=pack_weights, gemv_width=width, bf16_tiles=bf16_tiles)

    def gguf_matrix(name: str) -> BlockLinear:  # the GGUF's blocks, where they stand for this checkpoint's matrix
        lin, dense = blocks.linear(name), state.pop(name, None)
        if dense is not None and tuple(dense.shape) != (lin.out_features, lin.in_features):
            raise ModelLoadError(f"{blocks.path.name} holds {name} as [{lin.out_features}, {lin.in_features}], the "
                                 f"checkpoint as {list(dense.shape)}: the GGUF is not this model's")
        return lin

    def fused(names: list[str], bias=None):
        """The matrices `names` stacked by rows (fused q/k/v, gate/up) as one matmul."""
        if blocks is not None and all(blocks.has(n) and blocks.kind(n) in BLOCK_BYTES for n in names):
            return BlockLinear.cat([gguf_matrix(n) for n in names], bias)
        w = torch.cat([matrix(n) for n in names])
        return Int4Linear(w, bias) if int4 else linear(w, bias)

    embed = take("model.embed_tokens.weight")
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        bias = None
        if config.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        sandwich = config.sandwich_norms  # Gemma 2: post_attention_layernorm norms the attention's output
        layers.append(Layer(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=fused([p + f"self_attn.{n}_proj.weight" for n in "qkv"], bias),
            q_norm=take(p + "self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=take(p + "self_attn.k_norm.weight") if config.qk_norm else None,
            o=fused([p + "self_attn.o_proj.weight"]),
            post_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
            gate_up=fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            down=fused([p + "mlp.down_proj.weight"]),
            attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
            window=config.sliding_window if i in config.sliding_layers else None,
        ))
    final_norm = norm("model.norm.weight")
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if blocks is not None and blocks.has(head_name) and blocks.kind(head_name) in BLOCK_BYTES:
        head = gguf_matrix(head_name)
        state.pop("lm_head.weight", None)
    else:
        lm_head = take("lm_head.weight", required=not config.tie_word_embeddings)
        if lm_head is None:
            lm_head = embed  # tied: a packed layout is a copy, the plain one shares the embedding's memory
        head = linear(lm_head)
    model = LlamaModel(config, embed, layers, final_norm, head,
                       max_positions=max_positions or config.max_position_embeddings)
    if why and width is None and fp32_kernel == "auto" and torch.device(device).type == "cpu":
        model.layout_note = f"gemv unavailable: {why}"  # the conditions say why oneDNN serves instead
    return model


def _gguf_blocks(model_dir: str | Path, config: ModelConfig, device: str, dt: torch.dtype) -> GGUFBlocks:
    """The model's GGUF blocks, after checking that batchgen's low-bit kernel can run them here."""
    if torch.device(device).type != "cpu" or dt != torch.float32:
        raise ModelLoadError(f"quantization gguf runs on CPU with float32 activations, not {device} / {dt}")
    why = ggml.load()
    if isinstance(why, str):
        raise ModelLoadError(f"quantization gguf needs batchgen's qgemv kernel, which cannot be built here: {why}")
    try:
        return GGUFBlocks(ggml.find_gguf(model_dir), config.num_heads, config.num_kv_heads)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None


def count_decode_weight_elements(model_dir: str | Path) -> int:
    """Elements of every matrix one decode step reads (safetensors headers only, no tensors loaded).
    The embedding counts only when it doubles as the LM head (tied); otherwise just its looked-up rows."""
    import struct

    tied = read_hf_shape(model_dir)["tie_word_embeddings"]
    total = 0
    for f in _weight_files(Path(model_dir)):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__" or (name.endswith("embed_tokens.weight") and not tied):
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            total += numel
    return total
