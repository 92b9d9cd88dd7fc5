"""The batched sampler against numpy references."""

import numpy as np
import torch

from batchgen.engine.sampler import Sampler, hash_uniform


def sample(logits, temperature, top_p=1.0, top_k=0, seeds=None, counters=None):
    R, V = logits.shape
    s = Sampler(V, "cpu")
    t = torch.full((R,), float(temperature))
    return s(logits, t, torch.full((R,), float(top_p)), torch.full((R,), top_k, dtype=torch.int64),
             torch.tensor(seeds if seeds is not None else list(range(R)), dtype=torch.int64),
             torch.tensor(counters if counters is not None else [0] * R, dtype=torch.int64),
             all_greedy=temperature == 0, use_top=top_k > 0 or top_p < 1)


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    assert sample(logits, 0.0).tolist() == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_when_hot():
    logits = torch.randn(6, 50)
    assert sample(logits, 5.0, top_k=1).tolist() == logits.argmax(-1).tolist()


def test_hash_noise_is_uniform_and_depends_only_on_seed_and_counter():
    vocab = torch.arange(20000)
    u = hash_uniform(torch.tensor([7, 7, 8]), torch.tensor([3, 3, 3]), vocab)  # one lane per vocab id
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    x = u[0].numpy()
    assert 0 < x.min() and x.max() < 1
    hist, _ = np.histogram(x, bins=10, range=(0, 1))
    assert np.all(np.abs(hist - 2000) < 200)  # about 6 sigma of a binomial(20000, 0.1)


def test_seeded_draw_does_not_depend_on_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    alone = sample(logits[2:3], 1.0, seeds=[42], counters=[5])
    batched = sample(logits, 1.0, seeds=[1, 2, 42, 3], counters=[0, 0, 5, 0])
    assert alone.item() == batched[2].item()


def test_sampling_frequencies_follow_softmax_with_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    draws = sample(logits, 0.7, seeds=list(range(20000))).numpy()
    p = np.exp(logits[0].numpy() / 0.7)
    p /= p.sum()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.allclose(freq, p, atol=0.015)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, renormalised to 0.625 / 0.375
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = torch.tensor(np.log(probs), dtype=torch.float32)[None].repeat(20000, 1)
    draws = sample(logits, 1.0, top_p=0.7, seeds=list(range(20000))).numpy()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0] - 0.625) < 0.015


def _tensors(R, temperature, top_p, top_k, seeds):
    return (torch.full((R,), float(temperature)), torch.full((R,), float(top_p)),
            torch.full((R,), top_k, dtype=torch.int64), torch.tensor(seeds, dtype=torch.int64),
            torch.zeros(R, dtype=torch.int64))


def test_candidate_count_does_not_change_a_draw():
    # the kept set is a prefix of the sorted order: 64 candidates or the whole sorted vocabulary agree
    torch.manual_seed(1)
    logits = torch.randn(300, 5000) * 3
    s = Sampler(5000, "cpu")
    args = _tensors(300, 0.8, 0.9, 0, list(range(300)))
    few, short = s.sample(logits, *args, all_greedy=False, use_top=True, any_plain=False, max_top_k=0)
    many, _ = s.sample(logits, *args, all_greedy=False, use_top=True, any_plain=False, max_top_k=900)
    exact = s.exact(logits, *args)
    ok = ~short
    assert ok.sum() > 100  # most rows are served by the candidates
    assert torch.equal(few[ok], exact[ok]) and torch.equal(many, exact)


def test_flat_distribution_falls_back_to_the_exact_path():
    # nearly uniform, strictly decreasing logits: top_p 0.9 keeps about 9000 of 10000 tokens, far
    # past the candidates, and the kept ones are the lowest ids
    logits = (-1e-5 * torch.arange(10000.0))[None].repeat(2000, 1)
    s = Sampler(10000, "cpu")
    args = _tensors(2000, 1.0, 0.9, 0, list(range(2000)))
    _, short = s.sample(logits, *args, all_greedy=False, use_top=True, any_plain=False)
    assert bool(short.all())
    draws = s(logits, *args, all_greedy=False, use_top=True).numpy()
    assert draws.max() >= 1000 and draws.min() >= 0  # reaches past the first candidates
    assert 8500 < draws.max() < 9100  # the tail outside top_p is never drawn


def test_plain_rows_do_not_depend_on_top_p_rows_in_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(8, 400)
    s = Sampler(400, "cpu")
    temp, seeds = torch.full((8,), 0.9), torch.arange(8)
    counters = torch.zeros(8, dtype=torch.int64)
    plain = s(logits, temp, torch.ones(8), torch.zeros(8, dtype=torch.int64), seeds, counters, False, False)
    top_p = torch.tensor([1.0, 0.5] * 4)
    mixed = s(logits, temp, top_p, torch.zeros(8, dtype=torch.int64), seeds, counters, False, True)
    assert torch.equal(plain[0::2], mixed[0::2])


def test_large_top_k_past_the_candidate_cap_is_exact():
    torch.manual_seed(3)
    logits = torch.randn(500, 3000) * 0.1  # nearly flat: top_k 2000 keeps 2000 tokens
    draws = sample(logits, 1.0, top_k=2000, seeds=list(range(500)))
    order = logits.argsort(dim=-1, descending=True)
    ranks = (order == draws[:, None]).nonzero()[:, 1]
    assert ranks.max() < 2000 and ranks.max() > 1024  # beyond MAX_CANDIDATES, never past top_k
