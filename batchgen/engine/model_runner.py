"""The model runner: owns the device (the weights in their dtype and kernel, the paged KV pool, the
attention backend, the decode buckets and compile, the sampler) and runs one forward pass over a
scheduled step.

A step's tokens are every scheduled chunk's tokens side by side ([T], no padding): the running
requests' decode tokens and chunks of prompts, in one pass over the weights. The only host sync is
the final `.tolist()` of the sampled tokens (and, where asked, their logprobs, in the same transfer).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from batchgen import kernels
from batchgen.config import DTYPE_BYTES, EngineConfig, batchgen_home
from batchgen.engine.attention import TorchPagedAttention, make_backend
from batchgen.engine.attention_metadata import DECODE_KEYS, FAR, PREFILL_KEYS, PREFILL_TILE, AttentionMetadata, TileGroup
from batchgen.engine.decode_graphs import STEP_OPTIONS, DecodeGraphs
from batchgen.engine.kv_cache import PagedKVCache, free_memory_bytes
from batchgen.engine.plan import INVARIANT_MATMULS, EnginePlan
from batchgen.engine.resolve import plan_engine, plan_of_model
from batchgen.engine.request import Request
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import Chunk
from batchgen.model import activation, ggml, hugepages, rmsnorm, rope
from batchgen.model.linear import INT4_GROUP
from batchgen.model.llama import LlamaModel
from batchgen.model.loader import DTYPES, load_model, read_model_config


class ModelRunner:
    """Owns the device: chooses the dtype and the matmul kernel, loads the model, sizes and allocates
    the KV pool, picks the attention backend, and owns the decode buckets (graphs, compile) and the
    sampler. The engine asks it for one thing: `execute` a scheduled step."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, constraints=None, *,
                 model: LlamaModel | None = None, plan: EnginePlan | None = None):
        """`plan`: what to load and run (batchgen.engine.resolve.plan_engine; made here from `config`
        where not given). `model`: an already built model, e.g. random weights of a large shape for a
        benchmark (batchgen.model.random_init); then the plan is the model's. `constraints`
        (batchgen.engine.structured.GrammarConstraints) masks the constrained rows' logits."""
        c = model.config if model is not None else read_model_config(model_dir)
        self.model_config = c
        self.config = config
        self.device = config.device
        self.max_model_len = min(config.max_model_len, c.max_position_embeddings)
        if model is not None:
            self.model, self.plan = model, plan or plan_of_model(config, model)
        else:
            self.plan = plan or plan_engine("native", model_dir, config)
            self.model = self._load(model_dir, config, c, self.plan)
        if self.plan.batch_invariant and not self.model.matmul_kernels() <= set(INVARIANT_MATMULS):
            raise RuntimeError(f"the plan is batch-invariant, the loaded model's matmuls run on "
                               f"{sorted(self.model.matmul_kernels())}: {self.plan.describe()}")
        self.dtype = self.plan.dtype
        if config.device == "cpu" and config.huge_pages:  # in their final layouts, before any compile sees them
            hugepages.place_attributes(self.model.weight_holders())
        bpe = DTYPE_BYTES[self.dtype]
        self.kv_bytes_per_token = c.kv_bytes_per_token(bpe)
        self.row_embed_bytes = c.hidden_size * bpe
        bs = config.block_size
        # what the block manager hands out (EngineConfig.kv_blocks: the rule the vLLM engine sizes by too)
        self.num_blocks = config.kv_blocks(self.kv_bytes_per_token, bs, self.max_model_len,
                                           free_memory_bytes(config.device))
        # None without a cache: recompute the whole history every step (the lab's baseline)
        self.attention = make_backend(self.plan.attention, config.device) if config.enable_kv_cache else None
        graphs_mode = self._graphs_mode(config, self.attention)
        # with decode buckets, one more block than the allocator hands out: the padding rows' scratch block
        self.kv = (PagedKVCache(c.num_layers, self.num_blocks + (graphs_mode is not None), bs, c.num_kv_heads,
                                c.head_dim, DTYPES[self.dtype], config.device, self.attention.kv_layout,
                                huge_pages=config.huge_pages)
                   if self.attention else None)
        self.sampler = Sampler(c.vocab_size, config.device, config.sampler)
        self.constraints = constraints
        self.num_computed_positions = 0  # positions run through the model (the lab's count)
        if config.compile != "off":  # Inductor's on-disk cache beside the probe's: a machine compiles once
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kernels.compile_cache_dir()))  # per kernel build
        # decode-only steps in static buckets (graphs, compiled), or None
        # batch-invariant: the compiled step rounds where the eager one does (a decode row runs compiled in a
        # decode-only step and eager beside a prompt chunk, which depends on the other rows)
        options = {**STEP_OPTIONS, "emulate_precision_casts": True} if self.plan.batch_invariant else None
        self.graphs = (DecodeGraphs(self.model, self.kv, self.attention, scratch_block=self.num_blocks,
                                    device=config.device, mode=graphs_mode,
                                    compile_after_s=0.0 if config.compile == "on" else None, step_options=options)
                       if graphs_mode is not None else None)
        self.compile_s = self._compile(config)

    @staticmethod
    def _load(model_dir, config: EngineConfig, c, plan: EnginePlan) -> LlamaModel:
        """The weights the plan names, in the kernels' layouts, with batchgen's elementwise kernels where
        they build."""
        model = load_model(model_dir, plan.dtype, config.device, max_positions=min(config.max_model_len,
                                                                                    c.max_position_embeddings),
                           pack_weights=config.pack_weights, quantization=plan.quantization,
                           fp32_kernel="gemv" if plan.matmul == "gemv" else "onednn" if plan.matmul == "onednn"
                           else config.fp32_kernel, bf16_tiles=plan.matmul == "bgemm")
        if config.device == "cpu":
            # faster than torch's ops, and the same bits in the eager and the compiled step: the norm sums each
            # row in one order (Inductor's fused norm does not add as ATen's does), RoPE rounds where ATen does
            # and the gate/up matmul on the gemv or bgemm kernel applies SwiGLU as it writes (the same bits again)
            silu = activation.silu_mul if activation.load() is None else None
            roped = rope.load() is None
            model.use_kernels(norm=rmsnorm.rms_norm if rmsnorm.load() is None else None,
                              rope=rope.apply_rope if roped else None, silu=silu, fuse_swiglu=silu is not None,
                              rope_kv=rope.rope_kv if roped else None)
        if plan.dtype == "float32" and config.fp32_kernel == "auto" and plan.matmul in ("gemv", "onednn"):
            model.layout_note = plan.why.get("matmul")  # which kernel auto took, and the figures
        return model

    @staticmethod
    def _graphs_mode(config: EngineConfig, attention) -> str | None:
        """How decode-only steps run in static buckets (batchgen.engine.decode_graphs), or None (not at
        all). On CUDA: captured graphs (`--cuda-graphs`). On CPU: the whole step compiled per bucket
        (`--compile on`, or `auto`: once a bucket's eager time would have paid for it), or, with
        `--cuda-graphs on` and compile not asked for, the padded buckets run eagerly (the GPU path's
        bucketing, checkable without a GPU)."""
        if attention is None or not isinstance(attention, TorchPagedAttention):
            return None  # no cache (the lab), or a kernel that plans on the host each step (FlashInfer)
        if config.device.startswith("cuda"):
            return "capture" if config.cuda_graphs in ("on", "auto") else None
        if config.compile == "on" or (config.compile == "auto" and config.cuda_graphs != "on"):
            return "compile"
        return "eager" if config.cuda_graphs == "on" else None

    def _compile(self, config: EngineConfig) -> float | None:
        """The step's elementwise pieces compiled (RMSNorm, RoPE, the gated activation): on CUDA with
        `--compile auto|on`, and on CPU where `--compile on` has no whole step to compile (no KV cache).
        Where the decode step is compiled whole per bucket (CPU), that is done on each bucket's first use
        instead (see decode_graphs). Returns the seconds the compile took (paid here, on a warm-up
        forward, not inside the first step)."""
        on = config.compile == "on" or (config.compile == "auto" and config.device.startswith("cuda"))
        if not on or self.model.compiled or (self.graphs and self.graphs.mode == "compile"):
            return None
        t0 = time.perf_counter()
        # on CUDA, Inductor's reduce-overhead mode records the compiled kernels as CUDA graphs, unless the
        # whole decode step is captured (decode_graphs): graphs inside that capture would nest
        whole_step = self.graphs is not None and self.graphs.capture
        self.model.compile("reduce-overhead" if config.device.startswith("cuda") and not whole_step else None)
        try:
            self.model.warm_up()
        except Exception as e:  # a compiler that fails here must not take the run down: eager still works
            if config.compile == "on":
                raise
            self.model.uncompile(f"failed ({type(e).__name__}: {str(e)[:200]}), eager")
        return time.perf_counter() - t0

    def conditions(self) -> dict:
        """The device side of the run's conditions: dtype, kernels, attention, compile, graphs."""
        g = self.graphs
        if g is not None and g.mode == "compile":
            compile_ = ("auto: " if g.auto else "") + "whole decode step per bucket" + (
                f"; failed ({g.failed}), eager" if g.failed else "")
        else:
            compile_ = self.model.compiled or "off"
        return {
            "plan": self.plan.fields(),
            "dtype": self.dtype, "dtype_choice": self.plan.why.get("dtype", ""), "weight_layout": self.model.weight_layout,
            "quantization": self._quantization(), "kv_cache_bytes": self.kv.nbytes if self.kv else 0,
            "attention_backend": self.attention.name if self.attention else "none (recompute)",
            "weight_bytes": self.model.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "sampler": self.sampler.name, "compile": compile_,
            "compile_s": g.compile_s if g is not None and g.mode == "compile" else self.compile_s,
            "cuda_graphs": "off" if g is None else g.describe(),
            "batch_invariant": self.plan.invariance(),
            "huge_pages": self.huge_pages(),
        }

    def huge_pages(self) -> str:
        """How much of the weights and the KV pool sits on transparent huge pages (2 MiB), as the OS reports."""
        if self.device != "cpu":
            return f"n/a on {self.device}"
        if not self.config.huge_pages:
            return "off: torch's allocator (4 KiB pages unless THP is always)"
        weights = hugepages.tensors_of(self.model.weight_holders())
        kv = (self.kv.k + self.kv.v) if self.kv else []
        mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
        return (f"THP {hugepages.mode()}: weights {mib(hugepages.backed(weights))} of "
                f"{mib(sum(t.nbytes for t in weights))} MiB, KV pool {mib(hugepages.backed(kv))} of "
                f"{mib(sum(t.nbytes for t in kv))} MiB on huge pages")

    def _quantization(self) -> str | None:
        if self.plan.weights == "int4":
            return f"int4 weight-only, group {INT4_GROUP}, scale+zero (layers; head {self.dtype})"
        if self.plan.weights == "gguf":  # which block formats, and the instruction set the kernel runs
            mods = [m for l in self.model.layers for m in (l.qkv, l.o, l.gate_up, l.down)] + [self.model.lm_head]
            kinds = sorted({m.kind for m in mods if hasattr(m, "kind")})
            return f"gguf blocks as shipped ({', '.join(kinds)}), batchgen qgemv on {ggml.isa_name()}"
        return None

    def execute(self, chunks: list[Chunk]) -> tuple[list[int], list[tuple[float, list] | None] | None]:
        """Run the step. Returns the sampled tokens of each chunk that reaches its request's end, in
        order (one, or one per position from the newest token on where the chunk carries drafts), and,
        when any of them asked for logprobs, (chosen logprob, [(token, logprob)] top k) or None each."""
        # one logits row per sampled position: (request, its offset past the request's newest token)
        rows = [(c.request, j) for c in chunks for j in range(c.num_sampled)]
        sampling = [r for r, _ in rows]
        offsets = [j for _, j in rows]  # the noise counter of a draft position runs ahead
        if self.kv is None:  # without a cache only the chunks that sample need a pass (the lab's baseline)
            if not sampling:
                return [], None
            logits = self._recompute(sampling)
        else:
            logits = self._forward(chunks)
            if not sampling:  # only prompt chunks short of their end: still wait for the device, so
                if self.device.startswith("cuda"):  # the step's end time is when its work is done
                    torch.cuda.synchronize(self.device)
                return [], None
        masked = logits
        if self.constraints is not None and self.constraints.matchers:
            masked = logits.clone()  # a copy: logprobs stay those of the raw distribution
            self.constraints.mask(masked, [r.request_id for r in sampling])
        return self.sampler.choose(logits, masked, sampling, offsets)

    # ---- the paged forward -------------------------------------------------------------------------

    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        bs = self.kv.block_size
        kt_dec, kt_pf = max(1, DECODE_KEYS // bs), max(1, PREFILL_KEYS // bs)  # blocks per key tile
        tokens: list[int] = []
        positions: list[int] = []
        block_idx: list[int] = []
        logits_idx: list[int] = []
        dec_tok, dec_pos, dec_pair = [], [], ([], [], [])
        pf = _TileBuilder(PREFILL_TILE)
        ver = _TileBuilder(1 + max((len(c.drafts) for c in chunks), default=0))
        for c in chunks:
            req, base, end = c.request, len(tokens), c.start + c.num_tokens
            tokens += c.token_ids
            positions += range(c.start, end)
            table = req.block_table
            block_idx += [table[p // bs] for p in range(c.start, end)]
            logits_idx += range(base + c.num_tokens - c.num_sampled, base + c.num_tokens)
            if c.num_tokens == 1:
                _pairs(dec_pair, len(dec_tok), table, c.start, bs, kt_dec)
                dec_tok.append([base])
                dec_pos.append([c.start])
            elif c.drafts:
                ver.add(c, base, table, bs, kt_dec)
            else:
                pf.add(c, base, table, bs, kt_pf)
        self.num_computed_positions += len(tokens)

        def dynamic() -> torch.Tensor:  # the step at its own shapes
            i64 = dict(dtype=torch.int64, device=self.device)
            pos_t = torch.tensor(positions, **i64)
            meta = AttentionMetadata(
                decode=_group(dec_tok, dec_pos, None, dec_pair, i64) if dec_tok else None,
                prefill=pf.group(i64), verify=ver.group(i64),
                q_lens=[c.num_tokens for c in chunks], seq_lens=[c.start + c.num_tokens for c in chunks],
                block_tables=[c.request.block_table for c in chunks])
            return self.model.forward(torch.tensor(tokens, **i64), pos_t, self.kv, torch.tensor(block_idx, **i64),
                                      pos_t % bs, self.attention, meta, torch.tensor(logits_idx, **i64))

        if self.graphs is not None and len(dec_tok) == len(chunks):  # decode only: a bucket's static step
            return self.graphs.run(tokens, positions, block_idx, dec_pair, kt_dec, dynamic)
        return dynamic()

    # ---- the lab's baseline: no cache ------------------------------------------------------------

    def _recompute(self, reqs: list[Request]) -> torch.Tensor:
        seqs = [r.all_token_ids for r in reqs]
        self.num_computed_positions += sum(len(s) for s in seqs)
        width = max(len(s) for s in seqs)
        tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.int64, device=self.device)
        last = torch.tensor([len(s) - 1 for s in seqs], dtype=torch.int64, device=self.device)
        return self.model.prefill(tokens, last)


def _pairs(pairs: tuple[list, list, list], tile: int, table: list[int], last_pos: int, bs: int, kt: int) -> None:
    """The (query tile, key tile) pairs of a query tile whose last query sits at `last_pos`: its
    blocks 0 .. last_pos // bs in runs of `kt` (the last run padded with block table[0], masked)."""
    nb = last_pos // bs + 1
    for b0 in range(0, nb, kt):
        blocks = table[b0:min(b0 + kt, nb)]
        pairs[0].append(tile)
        pairs[1].append(blocks + [table[0]] * (kt - len(blocks)))
        pairs[2].append(b0 * bs)


class _TileBuilder:
    """Query tiles of `width` tokens over chunks of several tokens (the last tile of each padded)."""

    def __init__(self, width: int):
        self.width = width
        self.tok, self.pos, self.valid, self.pairs = [], [], [], ([], [], [])

    def add(self, c: Chunk, base: int, table: list[int], bs: int, kt: int) -> None:
        W = self.width
        for t0 in range(0, c.num_tokens, W):
            n = min(W, c.num_tokens - t0)
            pad = W - n
            _pairs(self.pairs, len(self.tok), table, c.start + t0 + n - 1, bs, kt)
            self.tok.append(list(range(base + t0, base + t0 + n)) + [0] * pad)
            self.pos.append(list(range(c.start + t0, c.start + t0 + n)) + [FAR] * pad)
            self.valid.append([True] * n + [False] * pad)

    def group(self, i64) -> TileGroup | None:
        return _group(self.tok, self.pos, self.valid, self.pairs, i64) if self.tok else None


def _group(tok, pos, valid, pairs, i64) -> TileGroup:
    return TileGroup(token_idx=torch.tensor(tok, **i64), q_pos=torch.tensor(pos, **i64),
                     valid=None if valid is None else torch.tensor(valid, dtype=torch.bool, device=i64["device"]),
                     pair_tile=torch.tensor(pairs[0], **i64), pair_blocks=torch.tensor(pairs[1], **i64),
                     pair_pos0=torch.tensor(pairs[2], **i64))
