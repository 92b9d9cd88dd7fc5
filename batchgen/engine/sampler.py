"""Batched sampling: greedy, temperature, top-k, top-p, with per-request reproducible randomness.

No Python loop over rows and no torch.Generator per request. Each draw uses one uniform number per
row from a counter-based hash of (seed, token index), so a request's draws do not depend on which
other requests share its batch or on scheduling order. The token is the inverse CDF of that
uniform, so no noise over the whole vocabulary is drawn and nothing is sorted in full:

- temperature only: the inverse CDF of softmax(logits / T) in vocabulary order, found in two levels
  (sums of blocks of ids, then inside one block);
- top-k / top-p: the `topk` candidates (at least CANDIDATES, at least the batch's largest top_k),
  their probabilities from the full-vocabulary log-sum-exp, the smallest prefix reaching top_p, then
  the inverse CDF within it. A row whose kept set would reach past the candidates (a flat
  distribution) is flagged and redone exactly over the sorted vocabulary (`exact`). The result is
  the same either way: the kept set is a prefix of the sorted order, so it does not depend on how
  many candidates were taken.

On CPU the same rule runs as one C++ call (batchgen/kernels/sample.cpp), built on the machine: the
torch version is about 40 small ops, each a pass over a row that the step's matmuls have just pushed
out of cache. The torch path serves CUDA, machines without a compiler, and `exact`.
"""

from __future__ import annotations

import time

import torch

from batchgen.config import SAMPLER_KERNELS

_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB
_LOW33 = (1 << 33) - 1
_LOW34 = (1 << 34) - 1
_LOW37 = (1 << 37) - 1
CANDIDATES = 128  # top-k / top-p candidates taken before any fallback
MAX_CANDIDATES = 1024  # a larger top_k is served by the exact path
EXACT_CANDIDATES = 2048  # the exact path's first try, before a full sort


def hash_uniform(seed: torch.Tensor, counter: torch.Tensor, lane: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform (0, 1) floats from splitmix64 over (seed, counter[, lane]): [R], or [R, L] with lanes.
    int64 arithmetic wraps on overflow; shifts are made logical by masking off the sign extension."""
    x = seed * _M1 + counter * _M2
    if lane is not None:
        x = x[:, None] + lane[None, :] * _M3
    x = x ^ ((x >> 30) & _LOW34)
    x = x * _M2
    x = x ^ ((x >> 27) & _LOW37)
    x = x * _M3
    x = x ^ ((x >> 31) & _LOW33)
    return (((x >> 40) & 0xFFFFFF).to(torch.float64) + 0.5) * (1.0 / (1 << 24))


def _below(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """x, kept strictly below total: u x total can round up to it, and the pick must have weight."""
    return torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first position whose cumulative weight passes u x the row's total; weights [R, N]
    non-negative (unnormalised), u [R] in (0, 1). Zero-weight positions are never picked."""
    cdf = weights.cumsum(dim=-1)
    x = _below(u.to(cdf.dtype) * cdf[:, -1], cdf[:, -1])
    return torch.searchsorted(cdf, x[:, None], right=True)[:, 0]


def _inverse_cdf_blocked(weights: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """`_inverse_cdf` over a whole vocabulary in two levels, since a cumulative sum over 50k-150k
    entries is sequential and slow: the sums of blocks of `block` ids (one vectorised pass), the
    block where u x total falls, then the position inside that one block. Sums run in float64."""
    R, V = weights.shape
    if V % block:
        weights = torch.nn.functional.pad(weights, (0, block - V % block))
    blocks = weights.view(R, -1, block)
    cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum_(dim=-1)  # [R, V / block]
    x = _below(u * cdf[:, -1], cdf[:, -1])
    b = torch.searchsorted(cdf, x[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = blocks[torch.arange(R, device=weights.device), b].double().cumsum_(dim=-1)  # [R, block]
    j = torch.searchsorted(inner, _below(x - before, inner[:, -1])[:, None], right=True)[:, 0]
    return b * block + j


def fused_kernel(choice: str, device) -> str | None:
    """None where the fused C++ sampler serves `device` under `choice`, else why not."""
    if choice not in SAMPLER_KERNELS:
        raise ValueError(f"sampler {choice!r}: one of {', '.join(SAMPLER_KERNELS)}")
    if choice == "torch":
        return "asked for"
    if torch.device(device).type != "cpu":
        why = "not on CPU"
    else:
        from batchgen import kernels

        why = kernels.load("sample")
    if why is not None and choice == "fused":
        raise RuntimeError(f"sampler fused asked for, but it cannot serve here: {why}")
    return why


class Sampler:
    def __init__(self, vocab_size: int, device, kernel: str = "auto"):
        self.vocab_size = vocab_size
        self.device = device
        self.torch_why = fused_kernel(kernel, device)  # None: the fused kernel samples
        self._buf: torch.Tensor | None = None  # scratch [rows, V] for the scaled logits
        # sampled rows whose top-p set reached past the candidates, redone over the whole vocabulary
        # (the torch path only: the fused kernel redoes them inside its call)
        self.num_exact_fallbacks = 0
        # host seconds choosing tokens from logits (argmax, or the sampler and its exact fallback): on CPU
        # their compute, which the bench reports as a share of the decode steps; on CUDA mostly launches
        # (the kernels run asynchronously until the step's one sync). Where a row asks for logprobs,
        # their log-softmax is included: it shares the tokens' transfer (the bench asks for none).
        self.seconds = 0.0

    @property
    def name(self) -> str:
        return "fused C++ (built on this machine)" if self.torch_why is None else f"torch ({self.torch_why})"

    @staticmethod
    def num_candidates(max_top_k: int, vocab_size: int) -> int:
        return min(vocab_size, max(CANDIDATES, min(max_top_k, MAX_CANDIDATES)))

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
               seed: torch.Tensor, counter: torch.Tensor, all_greedy: bool, use_top: bool, any_plain: bool = True,
               max_top_k: int = 0, any_greedy: bool = True) -> torch.Tensor:
        """logits [R, V] fp32; per-row temperature/top_p [R] float, top_k/seed/counter [R] int64.
        Host-side facts about the sampled rows, so that no branch needs a sync: use_top (some row has
        top-k or top-p), any_plain (some row has neither), max_top_k, any_greedy (some row has T = 0).
        Returns token ids [R] (greedy where temperature is 0). The torch path gives -1 at rows whose
        kept set reaches past the candidates (only with top-k/top-p), which `exact` redoes; the fused
        kernel redoes them inside its call."""
        if all_greedy:
            return self.argmax(logits)
        k = self.num_candidates(max_top_k, self.vocab_size)
        if self.torch_why is None:
            return torch.ops.batchgen_sample.sample(logits.float(), temperature, top_p, top_k, seed, counter, k)
        u = hash_uniform(seed, counter)
        inv_t = 1.0 / temperature.clamp(min=1e-5)
        # log-probabilities at temperature T, in a buffer kept across steps (no 50k x R allocation)
        logp = torch.log_softmax(torch.mul(logits, inv_t[:, None], out=self._scratch(logits)), dim=-1)
        sampled = short = None
        if any_plain or not use_top:  # temperature only: the whole vocabulary, in id order
            sampled = _inverse_cdf_blocked(logp.exp_() if not use_top else logp.exp(), u)
        if use_top:
            top, short = self._top(logits, logp, top_p, top_k, u, k)
            plain = (top_p >= 1.0) & (top_k <= 0)
            sampled = top if sampled is None else torch.where(plain, sampled, top)
            short &= ~plain & (temperature > 0)
        if any_greedy:
            sampled = torch.where(temperature > 0, sampled, self.argmax(logits))
        return sampled if short is None else torch.where(short, -1, sampled)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token [R]: torch.argmax's choice (the first id of the largest logit, a NaN
        the largest), by the fused kernel's argmax on CPU float32 rows (ATen's is single-threaded, a
        visible share of a wide decode step), by torch's elsewhere."""
        if self.torch_why is None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
            return torch.ops.batchgen_sample.argmax(logits)
        return logits.argmax(dim=-1)

    def _scratch(self, logits: torch.Tensor) -> torch.Tensor:
        R = logits.shape[0]
        if self._buf is None or self._buf.shape[0] < R or self._buf.dtype != logits.dtype:
            self._buf = torch.empty((max(R, 64), logits.shape[1]), dtype=logits.dtype, device=logits.device)
        return self._buf[:R]

    def _top(self, logits: torch.Tensor, logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
             u: torch.Tensor, k: int):
        """The candidates are the k largest raw logits (a positive temperature keeps the order);
        their probabilities come from the full softmax at the row's temperature."""
        idx = logits.topk(k, dim=-1).indices  # sorted, largest first
        probs = logp.gather(1, idx).exp_()  # [R, k]
        mass = probs.cumsum(dim=-1)
        ranks = torch.arange(k, device=logits.device)
        # the smallest prefix whose mass reaches top_p (the first candidate always stays), and top_k
        keep = ((mass - probs) < top_p[:, None]) & (ranks[None, :] < torch.where(top_k > 0, top_k, k)[:, None])
        if k < logits.shape[-1]:
            short = (mass[:, -1] < top_p) & ((top_k <= 0) | (top_k > k))
        else:
            short = torch.zeros_like(top_p, dtype=torch.bool)
        j = _inverse_cdf((probs * keep).double(), u)  # float64: k values, cheap
        return idx.gather(1, j[:, None])[:, 0], short

    def exact(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
              seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        """The flagged rows' tokens by the same rule with more candidates: EXACT_CANDIDATES first, then,
        for rows still short, the whole sorted vocabulary (a sort is slow: about 1.5 ms a row at 49k)."""
        logp = torch.log_softmax(logits * (1.0 / temperature.clamp(min=1e-5))[:, None], dim=-1)  # as `sample`
        u = hash_uniform(seed, counter)
        k = min(EXACT_CANDIDATES, logits.shape[-1])
        tokens, short = self._top(logits, logp, top_p, top_k, u, k)
        if k < logits.shape[-1] and bool(short.any()):
            rows = short.nonzero()[:, 0]
            tokens[rows] = self._top(logits[rows], logp[rows], top_p[rows], top_k[rows], u[rows], logits.shape[-1])[0]
        return tokens

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                 seed: torch.Tensor, counter: torch.Tensor, all_greedy: bool, use_top: bool) -> torch.Tensor:
        """`sample`, then `exact` for any flagged row (a second host sync, only then)."""
        max_top_k = int(top_k.max()) if use_top else 0
        tokens = self.sample(logits, temperature, top_p, top_k, seed, counter, all_greedy, use_top,
                             max_top_k=max_top_k)
        short = tokens < 0
        if bool(short.any()):
            rows = short.nonzero()[:, 0]
            tokens = tokens.clone()
            tokens[rows] = self.exact(logits[rows], temperature[rows], top_p[rows], top_k[rows], seed[rows],
                                      counter[rows])
        return tokens

    # ---- a step's rows: what the model runner calls ----------------------------------------------

    def choose(self, logits: torch.Tensor, masked: torch.Tensor, reqs: list, offsets: list[int]):
        """A step's tokens from its logits rows, one per (request, offset past its newest token):
        greedy, or sampled by each request's parameters and seed, from `masked` (the logits with the
        grammar's forbidden tokens at -inf), and, where a request asks, the logprobs of the raw
        distribution `logits`. Returns (tokens, [(chosen logprob, top k)] or None): one host sync,
        a second only when a row needs the exact path."""
        t0 = time.perf_counter()
        tokens = self._draw(masked, reqs, offsets)
        wants = [r.sampling.logprobs for r in reqs]
        info = None
        if all(k is None for k in wants):
            toks = tokens.tolist()  # the one host sync
        else:  # the logprobs come back in the tokens' transfer: still one sync
            toks, info = self.with_logprobs(logits, tokens, wants)
        if -1 in toks:  # a flat distribution reached past the candidates (torch sampler; rare): a 2nd sync
            toks = self._exact_rows(masked, reqs, offsets, toks)
            if info is not None:  # the chosen tokens' logprobs again, for the rows redone
                toks, info = self.with_logprobs(logits, torch.tensor(toks, device=tokens.device), wants)
        self.seconds += time.perf_counter() - t0
        return toks, info

    def _draw(self, logits: torch.Tensor, reqs: list, offsets: list[int]) -> torch.Tensor:
        """Tokens [R], with -1 at rows the sampler flagged for its exact path."""
        sp = [r.sampling for r in reqs]
        if all(s.greedy for s in sp):
            return self.argmax(logits)
        sampled = [s for s in sp if not s.greedy]
        return self.sample(logits, *self._tensors(reqs, offsets), all_greedy=False,
                           use_top=any(s.top_k > 0 or s.top_p < 1.0 for s in sampled),
                           any_plain=any(s.top_k <= 0 and s.top_p >= 1.0 for s in sampled),
                           max_top_k=max(s.top_k for s in sampled), any_greedy=len(sampled) < len(sp))

    def _tensors(self, reqs: list, offsets: list[int]) -> tuple[torch.Tensor, ...]:
        """temperature, top_p [R] float32; top_k, seed, counter [R] int64 (the counter: the index of
        the token being drawn). Two host-to-device copies a step, not five: views of two tensors."""
        R, sp = len(reqs), [r.sampling for r in reqs]
        f = torch.tensor([float(s.temperature) for s in sp] + [float(s.top_p) for s in sp], device=self.device)
        i = torch.tensor([s.top_k for s in sp] + [r.seed for r in reqs]
                         + [len(r.output_token_ids) + j for r, j in zip(reqs, offsets)],
                         dtype=torch.int64, device=self.device)
        return f[:R], f[R:], i[:R], i[R:2 * R], i[2 * R:]

    def _exact_rows(self, logits: torch.Tensor, reqs: list, offsets: list[int], toks: list[int]) -> list[int]:
        """Redo the flagged rows (-1) over the whole sorted vocabulary: a second sync, rare."""
        rows = [i for i, t in enumerate(toks) if t == -1]
        fixed = self.exact(logits[rows], *self._tensors([reqs[i] for i in rows], [offsets[i] for i in rows])).tolist()
        out = list(toks)
        for i, t in zip(rows, fixed):
            out[i] = t
        self.num_exact_fallbacks += len(rows)
        return out

    @staticmethod
    def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wants: list[int | None]):
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
