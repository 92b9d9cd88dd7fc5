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
    u = hash_uniform(torch.tensor([7, 7, 8]), torch.tensor([3, 3, 3]), vocab)
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
