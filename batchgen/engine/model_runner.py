"""The model runner: owns the device tensors (weights, the paged KV pool, the sampler's tables) and
runs one forward pass over a scheduled step.

A step's tokens are every scheduled chunk's tokens side by side ([T], no padding): the running
requests' decode tokens and chunks of prompts, in one pass over the weights. The only host sync is
the final `.tolist()` of the sampled tokens (and, where asked, their logprobs, in the same transfer).
"""

from __future__ import annotations

import time

import torch

from batchgen.engine.attention_metadata import DECODE_KEYS, FAR, PREFILL_KEYS, PREFILL_TILE, AttentionMetadata, TileGroup
from batchgen.engine.kv_cache import PagedKVCache
from batchgen.engine.request import Request
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import Chunk


class ModelRunner:
    def __init__(self, model, kv: PagedKVCache | None, attention, vocab_size: int, device: str, constraints=None,
                 sampler: str = "auto"):
        self.model = model  # batchgen.model.llama.LlamaModel
        self.kv = kv  # None: recompute the whole history every step (the lab's baseline)
        self.attention = attention  # batchgen.engine.attention.select_backend(device), or None without a cache
        self.device = device
        self.sampler = Sampler(vocab_size, device, sampler)  # sampler: batchgen.config.SAMPLER_KERNELS
        self.constraints = constraints  # batchgen.engine.structured.GrammarConstraints: masks constrained rows
        self.num_computed_positions = 0  # positions run through the model (the lab's count)
        # sampled rows whose top-p set reached past the candidates, redone by `_exact` (the torch sampler
        # only: the fused one redoes them inside its call)
        self.num_exact_fallbacks = 0
        # host seconds choosing tokens from logits (argmax, or the sampler and its exact fallback): on CPU
        # their compute, which the bench reports as a share of the decode steps; on CUDA mostly launches
        # (the kernels run asynchronously until the step's one sync). Where a row asks for logprobs,
        # their log-softmax is included: it now shares the tokens' transfer (the bench asks for none).
        self.sample_s = 0.0
        self.graphs = None  # batchgen.engine.decode_graphs.DecodeGraphs: decode-only steps in static buckets (graphs, compiled)

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
        t0 = time.perf_counter()
        tokens = self._sample(masked, sampling, offsets)
        wants = [r.sampling.logprobs for r in sampling]
        info = None
        if all(k is None for k in wants):
            toks = tokens.tolist()  # the one host sync
        else:  # the logprobs come back in the tokens' transfer: still one sync
            toks, info = self._with_logprobs(logits, tokens, wants)
        if -1 in toks:  # a flat distribution reached past the candidates (torch sampler; rare): a 2nd sync
            toks = self._exact(masked, sampling, offsets, toks)
            if info is not None:  # the chosen tokens' logprobs again, for the rows redone
                toks, info = self._with_logprobs(logits, torch.tensor(toks, device=tokens.device), wants)
        self.sample_s += time.perf_counter() - t0
        return toks, info

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wants: list[int | None]):
        """Log-probabilities of the raw model distribution (before temperature and top-k/p, as vLLM's
        default raw_logprobs): the chosen token's and the top k, read back in the same single sync."""
        R, k = tokens.shape[0], max(w or 0 for w in wants)
        lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        chosen = lp.gather(1, tokens.clamp(min=0)[:, None])[:, 0]  # [R] (a -1 row is redone by the caller)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], tokens[:, None][:, :0])  # [R, k]
        # float64 holds token ids exactly, so everything comes back in one transfer
        flat = torch.cat([tokens.double(), chosen.double(), top_v.double().flatten(), top_i.double().flatten()]).tolist()
        toks = [int(t) for t in flat[:R]]
        top_vals, top_ids = flat[2 * R:2 * R + R * k], flat[2 * R + R * k:]
        info = []
        for r, w in enumerate(wants):
            if w is None:
                info.append(None)
                continue
            alts = [(int(top_ids[r * k + j]), top_vals[r * k + j]) for j in range(w)]
            info.append((flat[R + r], alts))
        return toks, info

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

    # ---- sampling ----------------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, reqs: list[Request], offsets: list[int]) -> torch.Tensor:
        """Tokens [R], with -1 at rows the sampler flagged for its exact path (see `_exact`)."""
        sp = [r.sampling for r in reqs]
        if all(s.greedy for s in sp):
            return logits.argmax(dim=-1)
        sampled = [s for s in sp if not s.greedy]
        return self.sampler.sample(logits, *self._sampling_tensors(reqs, offsets), all_greedy=False,
                                   use_top=any(s.top_k > 0 or s.top_p < 1.0 for s in sampled),
                                   any_plain=any(s.top_k <= 0 and s.top_p >= 1.0 for s in sampled),
                                   max_top_k=max(s.top_k for s in sampled), any_greedy=len(sampled) < len(sp))

    def _sampling_tensors(self, reqs: list[Request], offsets: list[int]) -> tuple[torch.Tensor, ...]:
        """temperature, top_p [R] float32; top_k, seed, counter [R] int64 (the counter: the index of
        the token being drawn). Two host-to-device copies a step, not five: views of two tensors."""
        R, sp = len(reqs), [r.sampling for r in reqs]
        f = torch.tensor([float(s.temperature) for s in sp] + [float(s.top_p) for s in sp], device=self.device)
        i = torch.tensor([s.top_k for s in sp] + [r.seed for r in reqs]
                         + [len(r.output_token_ids) + j for r, j in zip(reqs, offsets)],
                         dtype=torch.int64, device=self.device)
        return f[:R], f[R:], i[:R], i[R:2 * R], i[2 * R:]

    def _exact(self, logits: torch.Tensor, reqs: list[Request], offsets: list[int], toks: list[int]) -> list[int]:
        """Redo the flagged rows (-1) over the whole sorted vocabulary: a second sync, rare."""
        rows = [i for i, t in enumerate(toks) if t == -1]
        fixed = self.sampler.exact(logits[rows], *self._sampling_tensors([reqs[i] for i in rows],
                                                                         [offsets[i] for i in rows])).tolist()
        out = list(toks)
        for i, t in zip(rows, fixed):
            out[i] = t
        self.num_exact_fallbacks += len(rows)
        return out


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
