"""The Llama-family forward pass (Llama 2/3.x with RoPE scaling, SmolLM, Mistral, Qwen2 with q/k/v bias,
Qwen3 with q/k norm), written for decode.

Shapes: T = tokens of a step (every sequence's chunk side by side), N = sequences in a padded batch
(the no-cache path), P = its padded length, H/Hkv = query/KV heads, G = H / Hkv, D = head_dim,
E = hidden size, V = vocab. Weights are fused at load (qkv, gate_up) so a layer is four matmuls, each
a `Linear` in the layout fastest for the device's kernel (batchgen.model.linear).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from batchgen.config import ModelConfig
from batchgen.model.linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed in fp32 like the HF reference, then cast back
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1]: rolling x by half a head
    gives [x2, x1], and `sin_signed` carries the minus on its first half (exact: a sign flip)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies [D/2], with Llama 3.x's or linear scaling where the config asks."""
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
    if c.rope_type == "linear":
        return inv_freq / c.rope_factor
    if c.rope_type == "llama3":  # low frequencies scaled by factor, high kept, a smooth blend between
        old_len = c.rope_original_max_position
        low_wavelen, high_wavelen = old_len / c.rope_low_freq_factor, old_len / c.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / c.rope_factor, inv_freq)
        smooth = (old_len / wavelen - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor)
        blended = (1 - smooth) * scaled / c.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # Gemma's GeGLU
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Layer:
    """One decoder layer's fused weights."""

    def __init__(self, input_norm, qkv: Linear, o: Linear, post_norm, gate_up: Linear, down: Linear, q_norm=None,
                 k_norm=None, attn_out_norm=None, mlp_out_norm=None, window=None):
        self.input_norm = input_norm  # [E]
        self.qkv = qkv  # [(H + 2 Hkv) D, E], with q/k/v bias where the model has one
        self.q_norm = q_norm  # [D] or None (qwen3)
        self.k_norm = k_norm  # [D] or None
        self.attn_out_norm = attn_out_norm  # [E] or None (Gemma 2's sandwich norms)
        self.mlp_out_norm = mlp_out_norm  # [E] or None
        self.window = window  # sliding-window size of this layer's attention, or None (full)
        self.o = o  # [E, H D]
        self.post_norm = post_norm  # [E], the norm before the MLP
        self.gate_up = gate_up  # [2 I, E]
        self.down = down  # [E, I]


class LlamaModel:
    """Holds the weights and runs prefill / decode against a KV cache (or none, for the lab)."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: Linear, max_positions: int):
        self.config = config
        self.embed = embed  # [V, E]
        self.layers = layers
        self.norm = norm  # [E]
        self.lm_head = lm_head  # [V, E]; the embedding's values when tied
        self.dtype = embed.dtype
        self.device = embed.device
        self.layout_note: str | None = None  # e.g. why float32's gemv kernel is not in use (batchgen.model.loader)
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.group = c.num_heads // c.num_kv_heads
        self.scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        # the step's elementwise pieces: plain functions, swapped for compiled ones by `compile`; the norm
        # and RoPE may be kernels instead (`use_kernels`), which stay as they are
        self.base_norm, self.base_rope = rms_norm, apply_rope
        self.norm_fn, self.rope_fn = rms_norm, apply_rope
        self.rope_kv = None  # a kernel for RoPE and the KV write in one pass (use_kernels), or None
        self.base_act = self.act_mul = silu_mul if c.hidden_act == "silu" else gelu_mul
        self.compiled = None
        inv_freq = rope_inv_freq(c)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_pos, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        sign = torch.cat((-torch.ones(c.head_dim // 2), torch.ones(c.head_dim // 2)))
        self.cos = emb.cos().to(self.dtype).to(self.device)
        self.sin = (emb.sin() * sign).to(self.dtype).to(self.device)  # signed for apply_rope

    @property
    def weight_bytes(self) -> int:
        """Bytes of every matrix read by one decode step (the embedding counted as its rows, so excluded)."""
        n = sum(t.numel() * t.element_size() for l in self.layers for t in (l.input_norm, l.post_norm))
        n += sum(m.nbytes for l in self.layers for m in (l.qkv, l.o, l.gate_up, l.down))
        return n + self.norm.numel() * self.norm.element_size() + self.lm_head.nbytes

    def weight_holders(self) -> list[object]:
        """The objects whose attributes hold the model's tensors: the model, its layers, their matrices."""
        out = [self, *self.layers]
        return out + [v for o in out for v in vars(o).values() if hasattr(v, "out_features")]

    def matmul_kernels(self) -> set[str]:
        """The kernels the model's matrices run on (Linear.kernel: gemv, bgemm, qgemv, onednn, int4, torch)."""
        return {m.kernel for l in self.layers for m in (l.qkv, l.o, l.gate_up, l.down)} | {self.lm_head.kernel}

    @property
    def weight_layout(self) -> str:
        layers, head = self.layers[0].qkv.layout, self.lm_head.layout
        layout = head if layers == head else f"layers: {layers}; head: {head}"
        return layout + (f" ({self.layout_note})" if self.layout_note else "")

    def use_kernels(self, norm=None, rope=None, silu=None, fuse_swiglu: bool = False, rope_kv=None) -> None:
        """Run RMSNorm with `norm`, RoPE with `rope` and SwiGLU's activation with `silu` where given
        (same signatures as rms_norm, apply_rope and silu_mul; `silu` only where the model's activation
        is SiLU), e.g. batchgen's kernels (batchgen.model.rmsnorm, .rope, .activation), which a compile
        leaves alone: opaque ops to Inductor. The rope kernel takes the step's shapes only, so the
        no-cache path (`prefill`) keeps apply_rope. `fuse_swiglu`: where `silu` is batchgen's kernel,
        the gate/up matmuls on the gemv or bgemm kernel apply it themselves (Linear.fuse_swiglu: the same bits,
        without the [T, 2I] product in memory). `rope_kv` (batchgen.model.rope.rope_kv): RoPE on q and k
        with the KV write in one pass, for the eager step (a compiled step keeps `rope` and the write)."""
        self.rope_kv = rope_kv
        if norm is not None:
            self.base_norm = self.norm_fn = norm
        if rope is not None:
            self.base_rope = self.rope_fn = rope
        if silu is not None and self.config.hidden_act == "silu":
            self.base_act = self.act_mul = silu
            if fuse_swiglu:
                for layer in self.layers:
                    if hasattr(layer.gate_up, "fuse_swiglu"):
                        layer.gate_up.fuse_swiglu()

    def compile(self, mode: str | None = None) -> None:
        """torch.compile (Inductor) the elementwise pieces around the matmuls: RMSNorm (6 ops), RoPE
        and the gated activation each become one fused kernel. Shapes are dynamic, so each compiles
        once (plus its batch-1 specialisation), not per step; Inductor's cache keeps the code on disk.
        The matmuls stay opaque kernels (batchgen.model.linear: batchgen's fp32 gemv, or oneDNN's
        prepacked one, which is what Inductor's freezing would call too)."""
        kw = {"dynamic": True, **({"mode": mode} if mode else {})}
        self.norm_fn = torch.compile(rms_norm, **kw) if self.base_norm is rms_norm else self.base_norm
        self.rope_fn = torch.compile(apply_rope, **kw) if self.base_rope is apply_rope else self.base_rope
        self.act_mul = torch.compile(self.base_act, **kw) if self.base_act in (silu_mul, gelu_mul) else self.base_act
        self.compiled = mode or "default"

    def uncompile(self, why: str) -> None:
        self.norm_fn, self.rope_fn, self.act_mul = self.base_norm, self.base_rope, self.base_act
        self.compiled = why

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the step's elementwise pieces at the shapes a step gives them (one token, and several:
        dynamic shapes specialise on 1), so compiling happens here rather than inside a timed step."""
        c, l0 = self.config, self.layers[0]
        for T in (1, 3):
            h = torch.zeros(T, c.hidden_size, dtype=self.dtype, device=self.device)
            self.norm_fn(h, l0.input_norm, c.rms_norm_eps)
            for heads in {c.num_heads, c.num_kv_heads}:
                x = torch.zeros(T, heads, c.head_dim, dtype=self.dtype, device=self.device)
                self.rope_fn(x, self.cos[:T, None], self.sin[:T, None])
                if l0.q_norm is not None:
                    self.norm_fn(x, l0.q_norm, c.rms_norm_eps)
            self.act_mul(torch.zeros(T, l0.gate_up.out_features, dtype=self.dtype, device=self.device))

    # ---- pieces shared by prefill and decode -------------------------------------------------

    def _qkv(self, layer: Layer, h: torch.Tensor):
        """h [..., E] -> q [..., H, D], k and v [..., Hkv, D] (q and k normalised per head where the model does)."""
        c = self.config
        x = self.norm_fn(h, layer.input_norm, c.rms_norm_eps)
        q, k, v = layer.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (c.num_heads, c.head_dim))
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))
        if layer.q_norm is not None:
            q, k = self.norm_fn(q, layer.q_norm, c.rms_norm_eps), self.norm_fn(k, layer.k_norm, c.rms_norm_eps)
        return q, k, v.unflatten(-1, (c.num_kv_heads, c.head_dim))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed[tokens]
        if self.config.embed_scale != 1.0:  # Gemma: scaled by sqrt(hidden), in the weights' dtype as HF does
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def _attn_residual(self, layer: Layer, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """h + the attention output o [..., H D] through o_proj (and Gemma 2's output norm)."""
        if layer.attn_out_norm is None:
            return layer.o.add_to(o, h)  # the add in the matmul's epilogue where its kernel has one
        return h + self.norm_fn(layer.o(o), layer.attn_out_norm, self.config.rms_norm_eps)

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        x = self.norm_fn(h, layer.post_norm, self.config.rms_norm_eps)
        gu = layer.gate_up
        act = gu.swiglu(x) if getattr(gu, "gated", None) is not None else self.act_mul(gu(x))
        if layer.mlp_out_norm is None:
            return layer.down.add_to(act, h)
        return h + self.norm_fn(layer.down(act), layer.mlp_out_norm, self.config.rms_norm_eps)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm_fn(h, self.norm, self.config.rms_norm_eps)).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- the step: every scheduled chunk's tokens side by side, K/V in the paged cache ------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv, block_idx: torch.Tensor,
                offset: torch.Tensor, attention, meta, logits_idx: torch.Tensor) -> torch.Tensor:
        """tokens, positions, block_idx, offset: [T] (a token's K/V goes to slot `offset` of block
        `block_idx`); `attention(q, k_cache, v_cache, meta, scale)` reads the paged cache.
        Returns logits [R, V] at the tokens `logits_idx` [R]."""
        return self.step(tokens, positions, kv, block_idx, offset, attention, meta, logits_idx)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, kv, block_idx: torch.Tensor,
             offset: torch.Tensor, attention, meta, logits_idx: torch.Tensor) -> torch.Tensor:
        """`forward` without its inference mode: what torch.compile traces (under no_grad; Dynamo
        cannot fake the inference tensors that inference mode creates), see decode_graphs."""
        c = self.config
        T, Hkv, G, D = tokens.shape[0], c.num_kv_heads, self.group, c.head_dim
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [T, 1, D]
        h = self._embed(tokens)  # [T, E]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h)  # [T, H, D], [T, Hkv, D], [T, Hkv, D]
            # the KV write first, so a chunk's queries see their own keys
            if self.rope_kv is not None and not torch.compiler.is_compiling():
                q = self.rope_kv(q, k, v, cos, sin, *kv.hnd(i), block_idx, offset)
            else:
                q, k = self.rope_fn(q, cos, sin), self.rope_fn(k, cos, sin)
                kv.write(i, block_idx, offset, k, v)
            k_cache, v_cache = kv.layer(i)
            o = attention(q.view(T, Hkv, G, D), k_cache, v_cache, meta, self.scale,
                          window=layer.window, softcap=c.attn_softcap)  # [T, Hkv, G, D]
            h = self._attn_residual(layer, h, o.reshape(T, self.q_size))
            h = self._mlp(layer, h)
        return self._logits(h[logits_idx])

    # ---- no cache: whole sequences, causal attention (the lab's recompute baseline) -------------

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
        """tokens [N, P] right-padded; last_idx [N] index of each row's last real token.
        Returns logits [N, V] at last_idx."""
        c = self.config
        N, P = tokens.shape
        cos, sin = self.cos[:P], self.sin[:P]  # [P, D]
        h = self._embed(tokens)  # [N, P, E]
        pos = torch.arange(P, device=h.device)
        rope = self.rope_fn if self.base_rope is apply_rope else apply_rope  # a rope kernel takes the step's shapes
        for layer in self.layers:
            q, k, v = (x.transpose(1, 2) for x in self._qkv(layer, h))  # [N, H, P, D], [N, Hkv, P, D] x2
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            if layer.window is None and c.attn_softcap is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                   enable_gqa=self.group > 1)
            else:  # a sliding window or soft-capped scores: written out
                k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
                s = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale  # [N, H, P, P]
                if c.attn_softcap is not None:
                    s = torch.tanh(s / c.attn_softcap) * c.attn_softcap
                hidden = pos[None, :] > pos[:, None]
                if layer.window is not None:
                    hidden |= pos[None, :] <= pos[:, None] - layer.window
                o = torch.matmul(s.masked_fill(hidden, float("-inf")).softmax(-1).to(v.dtype), v)
            h = self._attn_residual(layer, h, o.transpose(1, 2).reshape(N, P, self.q_size))
            h = self._mlp(layer, h)
        h_last = h[torch.arange(N, device=h.device), last_idx]  # [N, E]
        return self._logits(h_last)
