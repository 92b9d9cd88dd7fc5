"""Batched sampling: greedy, temperature, top-k, top-p, with per-request reproducible noise.

No Python loop over rows and no torch.Generator per request: the noise for (seed, token index,
vocab id) comes from a counter-based integer hash computed as one tensor op chain, so a request's
random draws do not depend on which other requests share its batch or on scheduling order.
Sampling uses the exponential-race trick (argmax of probs / Exp(1) noise), as vLLM does.
"""

from __future__ import annotations

import torch

_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB
_LOW33 = (1 << 33) - 1
_LOW34 = (1 << 34) - 1
_LOW37 = (1 << 37) - 1


def hash_uniform(seed: torch.Tensor, counter: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) floats [R, V] from splitmix64 over (seed, counter, vocab id); int64 wraps on overflow."""
    x = (seed * _M1 + counter * _M2)[:, None] + vocab[None, :] * _M3  # [R, V]
    x = x ^ ((x >> 30) & _LOW34)  # logical shifts: mask off the sign extension
    x = x * _M2
    x = x ^ ((x >> 27) & _LOW37)
    x = x * _M3
    x = x ^ ((x >> 31) & _LOW33)
    return (((x >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


class Sampler:
    def __init__(self, vocab_size: int, device):
        self.vocab = torch.arange(vocab_size, device=device, dtype=torch.int64)

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                 seed: torch.Tensor, counter: torch.Tensor, all_greedy: bool, use_top: bool) -> torch.Tensor:
        """logits [R, V] fp32; per-row temperature/top_p [R] float, top_k/seed/counter [R] int64.
        Returns sampled token ids [R] (greedy where temperature is 0)."""
        greedy = logits.argmax(dim=-1)
        if all_greedy:
            return greedy
        scaled = logits / temperature.clamp(min=1e-5)[:, None]
        if use_top:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [R, V]
            ranks = self.vocab[None, :]
            k = torch.where(top_k > 0, top_k, self.vocab.numel())
            drop = ranks >= k[:, None]
            probs_sorted = sorted_logits.softmax(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop |= (probs_sorted.cumsum(dim=-1) - probs_sorted) >= top_p[:, None]
            sorted_logits.masked_fill_(drop, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
        probs = scaled.softmax(dim=-1)
        noise = -torch.log(hash_uniform(seed, counter, self.vocab))  # Exp(1), [R, V]
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperature > 0, sampled, greedy)
