"""The batched sampler against numpy references, on both of its paths: the fused C++ kernel
(batchgen/kernels/sample.cpp, built on this machine) and the torch ops."""

import numpy as np
import pytest
import torch

from batchgen import kernels
from batchgen.engine.sampler import Sampler, fused_kernel, hash_uniform

FUSED_WHY = fused_kernel("auto", "cpu")  # None: the fused kernel built here
needs_fused = pytest.mark.needs(f"no fused kernel: {FUSED_WHY}" if FUSED_WHY else None, "BATCHGEN_REQUIRE_KERNELS")


@pytest.fixture(params=[pytest.param("fused", marks=needs_fused), "torch"])
def kernel(request):
    return request.param


def sample(logits, temperature, top_p=1.0, top_k=0, seeds=None, counters=None, kernel="torch"):
    R, V = logits.shape
    s = Sampler(V, "cpu", kernel)
    t = torch.full((R,), float(temperature))
    return s(logits, t, torch.full((R,), float(top_p)), torch.full((R,), top_k, dtype=torch.int64),
             torch.tensor(seeds if seeds is not None else list(range(R)), dtype=torch.int64),
             torch.tensor(counters if counters is not None else [0] * R, dtype=torch.int64),
             all_greedy=temperature == 0, use_top=top_k > 0 or top_p < 1)


def test_greedy_is_argmax(kernel):
    logits = torch.randn(5, 100)
    assert sample(logits, 0.0, kernel=kernel).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("R,V", [(1, 49152), (3, 7), (64, 1000)])
def test_greedy_is_torch_argmax_with_its_ties_nan_and_infinities(kernel, R, V):
    """The fused kernel's argmax picks as torch.argmax does: the first of equal maxima (-0.0 equals
    0.0), a NaN as the largest (the first NaN), a row of -inf at id 0."""
    logits = torch.randn(R, V, generator=torch.Generator().manual_seed(R))
    if R > 1:
        logits[1] = float("-inf")
        logits[2, [3, V - 1]] = 100.0  # a tie: the first id
    if R > 3:
        logits[3, [5, 9]] = float("nan")
        logits[4] = 0.0
        logits[4, 2] = -0.0
        logits[5, V - 1] = float("inf")
    got = Sampler(V, "cpu", kernel).argmax(logits)
    assert got.dtype == torch.int64 and got.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_when_hot(kernel):
    logits = torch.randn(6, 50)
    assert sample(logits, 5.0, top_k=1, kernel=kernel).tolist() == logits.argmax(-1).tolist()


def test_hash_noise_is_uniform_and_depends_only_on_seed_and_counter():
    vocab = torch.arange(20000)
    u = hash_uniform(torch.tensor([7, 7, 8]), torch.tensor([3, 3, 3]), vocab)  # one lane per vocab id
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    x = u[0].numpy()
    assert 0 < x.min() and x.max() < 1
    hist, _ = np.histogram(x, bins=10, range=(0, 1))
    assert np.all(np.abs(hist - 2000) < 200)  # about 6 sigma of a binomial(20000, 0.1)


def test_seeded_draw_does_not_depend_on_batch_composition(kernel):
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    alone = sample(logits[2:3], 1.0, seeds=[42], counters=[5], kernel=kernel)
    batched = sample(logits, 1.0, seeds=[1, 2, 42, 3], counters=[0, 0, 5, 0], kernel=kernel)
    assert alone.item() == batched[2].item()


def test_sampling_frequencies_follow_softmax_with_temperature(kernel):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    draws = sample(logits, 0.7, seeds=list(range(20000)), kernel=kernel).numpy()
    p = np.exp(logits[0].numpy() / 0.7)
    p /= p.sum()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.allclose(freq, p, atol=0.015)


def test_top_p_keeps_the_smallest_prefix_reaching_p(kernel):
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, renormalised to 0.625 / 0.375
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = torch.tensor(np.log(probs), dtype=torch.float32)[None].repeat(20000, 1)
    draws = sample(logits, 1.0, top_p=0.7, seeds=list(range(20000)), kernel=kernel).numpy()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0] - 0.625) < 0.015


def _tensors(R, temperature, top_p, top_k, seeds):
    return (torch.full((R,), float(temperature)), torch.full((R,), float(top_p)),
            torch.full((R,), top_k, dtype=torch.int64), torch.tensor(seeds, dtype=torch.int64),
            torch.zeros(R, dtype=torch.int64))


def test_candidate_count_does_not_change_a_draw(kernel):
    # the kept set is a prefix of the sorted order: 64 candidates or the whole sorted vocabulary agree
    torch.manual_seed(1)
    logits = torch.randn(300, 5000) * 3
    s = Sampler(5000, "cpu", kernel)
    args = _tensors(300, 0.8, 0.9, 0, list(range(300)))
    few = s.sample(logits, *args, all_greedy=False, use_top=True, any_plain=False, max_top_k=0)
    many = s.sample(logits, *args, all_greedy=False, use_top=True, any_plain=False, max_top_k=900)
    exact = Sampler(5000, "cpu", "torch").exact(logits, *args)
    ok = few >= 0  # the torch path flags the rows it cannot serve from the candidates (-1); the fused one
    assert ok.sum() > 100  # redoes them itself. Most rows are served by the candidates
    assert torch.equal(few[ok], exact[ok]) and torch.equal(many, exact)
    assert bool(ok.all()) == (kernel == "fused")


def test_flat_distribution_falls_back_to_the_exact_path(kernel):
    # nearly uniform, strictly decreasing logits: top_p 0.9 keeps about 9000 of 10000 tokens, far
    # past the candidates, and the kept ones are the lowest ids
    logits = (-1e-5 * torch.arange(10000.0))[None].repeat(2000, 1)
    s = Sampler(10000, "cpu", kernel)
    args = _tensors(2000, 1.0, 0.9, 0, list(range(2000)))
    first = s.sample(logits, *args, all_greedy=False, use_top=True, any_plain=False)
    assert bool((first < 0).all()) == (kernel == "torch")  # flagged for `exact` (torch), or done (fused)
    draws = s(logits, *args, all_greedy=False, use_top=True).numpy()
    assert draws.max() >= 1000 and draws.min() >= 0  # reaches past the first candidates
    assert 8500 < draws.max() < 9100  # the tail outside top_p is never drawn


def test_plain_rows_do_not_depend_on_top_p_rows_in_the_batch(kernel):
    torch.manual_seed(2)
    logits = torch.randn(8, 400)
    s = Sampler(400, "cpu", kernel)
    temp, seeds = torch.full((8,), 0.9), torch.arange(8)
    counters = torch.zeros(8, dtype=torch.int64)
    plain = s(logits, temp, torch.ones(8), torch.zeros(8, dtype=torch.int64), seeds, counters, False, False)
    top_p = torch.tensor([1.0, 0.5] * 4)
    mixed = s(logits, temp, top_p, torch.zeros(8, dtype=torch.int64), seeds, counters, False, True)
    assert torch.equal(plain[0::2], mixed[0::2])


def test_large_top_k_past_the_candidate_cap_is_exact(kernel):
    torch.manual_seed(3)
    logits = torch.randn(500, 3000) * 0.1  # nearly flat: top_k 2000 keeps 2000 tokens
    draws = sample(logits, 1.0, top_k=2000, seeds=list(range(500)), kernel=kernel)
    order = logits.argsort(dim=-1, descending=True)
    ranks = (order == draws[:, None]).nonzero()[:, 1]
    assert ranks.max() < 2000 and ranks.max() > 1024  # beyond MAX_CANDIDATES, never past top_k


@needs_fused
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.95, 0), (1.0, 1.0, 0), (0.7, 1.0, 50), (1.3, 0.9, 0),
                                                     (0.5, 0.5, 5), (2.0, 0.9, 900), (1.0, 0.95, 2000)])
def test_the_fused_kernel_draws_the_torch_paths_tokens(temperature, top_p, top_k):
    """Same rule, same hash: the same token per row, with a few rows of every batch mixing greedy,
    temperature-only and top-p rows, on peaked rows (a model's) and flat ones (the exact path)."""
    g = torch.Generator().manual_seed(int(temperature * 100 + top_p * 10 + top_k))
    logits = torch.randn(96, 8192, generator=g) * 2
    logits[:64, :40] += torch.linspace(14, 4, 40)  # peaked rows; the last 32 stay flat
    R = logits.shape[0]
    temp = torch.full((R,), temperature)
    temp[::7] = 0.0  # greedy rows in the batch
    tp, tk = torch.full((R,), top_p), torch.full((R,), top_k, dtype=torch.int64)
    tp[1::5], tk[1::5] = 1.0, 0  # temperature-only rows in the batch
    args = (temp, tp, tk, torch.arange(R) * 7919 + 3, torch.arange(R) % 5)
    fused = Sampler(8192, "cpu", "fused")(logits, *args, all_greedy=False, use_top=True)
    torch_ = Sampler(8192, "cpu", "torch")(logits, *args, all_greedy=False, use_top=True)
    assert torch.equal(fused, torch_)


def test_masked_tokens_are_never_drawn(kernel):
    """Structured output masks disallowed tokens with -inf: greedy, temperature-only and top-p rows
    only ever draw allowed ones."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(300, 3000, generator=g)
    allowed = torch.zeros(3000, dtype=torch.bool)
    allowed[torch.tensor([3, 700, 1999, 2998])] = True
    logits[:, ~allowed] = float("-inf")
    for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (1.5, 0.99), (0.8, 0.5)):
        draws = sample(logits, temperature, top_p=top_p, seeds=list(range(300)), kernel=kernel)
        assert bool(allowed[draws].all()), (temperature, top_p)


@needs_fused
def test_without_a_compiler_auto_samples_with_torch_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    s = Sampler(100, "cpu", "auto")
    assert s.name.startswith("torch (") and "no C++ compiler" in s.name
    with pytest.raises(RuntimeError, match="cannot serve here"):
        Sampler(100, "cpu", "fused")
    assert Sampler(100, "cuda", "auto").name == "torch (not on CPU)"  # no CUDA needed to decide
    # set-up's `batchgen kernels build` says the same, and is not an error
    assert [line.split(" (")[0] for line in kernels.build_all()] == [f"{n}: unavailable here" for n in kernels.NAMES]


@needs_fused
def test_the_engine_samples_the_same_tokens_with_either_sampler_on_the_real_model(real_model_dir):
    """Sampled generation (T 0.8, top-p 0.9, and one row with top-k 20) through the native engine:
    the fused kernel and the torch path give the same tokens, and the conditions say which ran."""
    from batchgen.config import SamplingParams

    from conftest import engine_tokens

    def run(sampler: str):
        out, cond = engine_tokens(real_model_dir, ["Name three rivers.", "Write a haiku about rain.",
                                                   "Say hello in Spanish.", "Tell a story."],
                                  lambda i: SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9,
                                                           top_k=20 if i == 3 else 0, seed=i),
                                  dtype="float32", max_num_seqs=4, max_model_len=256, compile="off", sampler=sampler)
        return out, cond["sampler"]

    got, name = run("fused")
    ref, ref_name = run("torch")
    assert name == "fused C++ (built on this machine)" and ref_name == "torch (asked for)"
    assert got == ref and len(got) == 4


def test_the_sampler_choice_reaches_the_engine_from_the_run_settings():
    """The same field drives the CLI flag (--sampler), the flow parameter and the UI's form."""
    from pydantic import ValidationError

    from batchgen.config import EngineConfig
    from batchgen.settings import GenerateSettings

    assert GenerateSettings(input=["x.parquet"], sampler="torch").to_run_config().engine_config.sampler == "torch"
    assert GenerateSettings(input=["x.parquet"]).to_run_config().engine_config.sampler == "auto"
    with pytest.raises(ValidationError):
        GenerateSettings(input=["x.parquet"], sampler="numpy")
    with pytest.raises(ValueError, match="sampler must be one of"):
        EngineConfig(sampler="numpy")



def test_logprobs_come_back_with_the_tokens_and_match_them_on_redone_rows(tiny_model_dir):
    """The tiny random model's rows are flat: with top-p 0.95 the torch sampler flags them for its exact
    path after the step's one transfer. Their logprobs must then be those of the token finally chosen
    (the fused kernel, which redoes such rows inside its call, is the reference), and asking for
    logprobs must not change a token."""
    from batchgen.config import EngineConfig, SamplingParams
    from batchgen.engine.native import NativeEngine

    def run(kernel, logprobs):
        e = NativeEngine(tiny_model_dir, EngineConfig(dtype="float32", max_num_seqs=3, max_model_len=64,
                                                      compile="off", sampler=kernel))
        for i in range(3):
            e.add(str(i), list(range(10 + i, 20 + 2 * i)),
                  SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.2, top_p=0.95, seed=i, logprobs=logprobs))
        toks, lps = {}, []
        while e.has_unfinished():
            r = e.step()
            lps += zip(r.token_request_ids, r.token_indices, r.token_logprobs, r.token_top_logprobs)
            toks.update({f.request_id: f.output_token_ids for f in r.finished})
        return toks, [(toks[rid][i], lp, top) for rid, i, lp, top in lps], e.runner.sampler.num_exact_fallbacks

    plain, _, _ = run("torch", None)
    toks, lps, redone = run("torch", 3)
    assert toks == plain and redone > 0 and len(lps) == 15
    for tok, lp, top in lps:
        assert lp <= 0 and len(top) == 3 and top[0][1] >= lp  # the chosen token's, under the best one
    if FUSED_WHY is None:
        f_toks, f_lps, f_redone = run("fused", 3)
        assert f_toks == toks and f_redone == 0
        assert [(t, pytest.approx(lp, abs=1e-5)) for t, lp, _ in f_lps] == [(t, lp) for t, lp, _ in lps]
