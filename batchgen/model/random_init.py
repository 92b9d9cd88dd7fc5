"""Random weights of a named shape, built directly on the device: a benchmark of an 8B-class model
needs its shape and its bytes, not its knowledge, and no download."""

from __future__ import annotations

import torch

from batchgen.config import ModelConfig
from batchgen.model.linear import Linear
from batchgen.model.llama import Layer, LlamaModel

SHAPES = {
    # Llama-3-8B / 3.1-8B: 32 layers, GQA 32/8 heads of 128, SwiGLU 14336, vocab 128256, llama3 RoPE
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
                      eos_token_ids=(128001,), rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_position=8192),
    # the same architecture, small enough for a CPU in minutes (the code path of the script, not its figures)
    "small": dict(model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=6,
                  num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=4096, tie_word_embeddings=False, eos_token_ids=(0,)),
}


def random_model(shape: str, dtype: torch.dtype, device: str, max_positions: int, seed: int = 0) -> LlamaModel:
    c = ModelConfig(**SHAPES[shape])
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*size, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    E, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    layers = [Layer(input_norm=ones(E), qkv=Linear(w((c.num_heads + 2 * c.num_kv_heads) * D, E)),
                    o=Linear(w(E, c.num_heads * D)), post_norm=ones(E), gate_up=Linear(w(2 * I, E)),
                    down=Linear(w(E, I))) for _ in range(c.num_layers)]
    return LlamaModel(c, w(c.vocab_size, E), layers, ones(E), Linear(w(c.vocab_size, E)),
                      max_positions=max_positions)


class IdTokenizer:
    """Token ids as text: the engine decodes finished outputs, and random weights have no vocabulary
    (nor a chat template: no think markers)."""

    template_source = None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def token_id(self, text: str) -> int | None:
        return None
