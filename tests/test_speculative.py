"""N-gram speculation: the proposer, and output identical with speculation on and off."""

import pytest

from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine.native import NativeEngine
from batchgen.engine.speculative import NgramProposer

TEXT = ("Alice met Bob at the station on Monday, and they took the 9:15 train to Cambridge, where they "
        "visited the library and the museum before lunch.")
COPY = [f"Copy the following text word for word: {TEXT} (copy {i})" for i in range(4)]
OPEN = [f"Write a poem about the number {i}." for i in range(4)]


def test_proposer_takes_the_longest_match_and_its_latest_occurrence():
    p = NgramProposer(3, min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7]
    # suffix (6, 7) last seen at 5 (followed by 9, 4); the 3-gram (4, 6, 7) is new
    assert p.propose("a", tokens, 3) == [9, 4, 6]
    assert p.propose("b", tokens, 1) == [9]  # the limit (max_tokens, the context) caps the drafts
    assert p.propose("c", [1, 2, 3], 3) == []  # nothing repeats
    # incremental: more tokens arrive, the index follows
    tokens += [9, 4]
    assert p.propose("a", tokens, 3) == [6, 7, 9]  # (7, 9, 4) seen at 6, followed by 6, 7, 9
    p.drop("a")
    assert "a" not in p._index


def test_proposer_index_equals_a_fresh_scan():
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(12)]
    p = NgramProposer(4, 2, 4)
    for _ in range(60):
        fresh = NgramProposer(4, 2, 4).propose("x", tokens, 4)
        assert p.propose("x", tokens, 4) == fresh
        tokens.append(rng.randrange(6))


def _run(model_dir, prompts, k, temperature=0.0, seed=None, **kw):
    e = NativeEngine(model_dir, EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=512,
                                             speculative_ngram=k, **kw))
    chat = [e.tokenizer.encode(e.tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    for i, ids in enumerate(chat):
        e.add(str(i), ids, SamplingParams(max_tokens=48, temperature=temperature, seed=seed))
    out, steps, drafts, accepted = {}, 0, 0, 0
    e.preempted = 0
    while e.has_unfinished():
        r = e.step()
        steps += 1
        e.preempted += r.num_preempted
        drafts += r.num_draft_tokens
        accepted += r.num_accepted_tokens
        assert r.num_accepted_tokens <= r.num_draft_tokens
        out.update({f.request_id: f.output_token_ids for f in r.finished})
    assert (drafts, accepted) == (e.num_draft_tokens, e.num_accepted_tokens)
    return out, steps, drafts, accepted, e


@pytest.mark.slow
def test_greedy_output_is_identical_with_speculation(real_model_dir):
    for prompts in (COPY, OPEN):
        plain, plain_steps, d0, _, _ = _run(real_model_dir, prompts, 0)
        spec, spec_steps, drafts, accepted, e = _run(real_model_dir, prompts, 4)
        assert spec == plain and d0 == 0
        assert drafts > 0 and e.conditions()["speculative"]["method"] == "ngram"
        if prompts is COPY:  # copying from the prompt: most drafts are right, and steps are saved
            assert accepted / drafts > 0.5 and spec_steps < plain_steps


@pytest.mark.slow
def test_seeded_samples_are_identical_with_speculation(real_model_dir):
    plain = _run(real_model_dir, COPY + OPEN[:1], 0, temperature=0.8, seed=7)[0]
    spec, _, drafts, accepted, _ = _run(real_model_dir, COPY + OPEN[:1], 3, temperature=0.8, seed=7)
    assert spec == plain and accepted > 0


def test_speculation_under_preemption_and_a_small_pool(tiny_model_dir):
    """Drafts in a pool too small for every sequence: preemption, recompute, and the same tokens."""
    prompts = ["one two three one two three one two", "a b a b a b a b a b", "x y z x y z x y", "1 2 1 2 1 2 1 2"]
    kw = dict(block_size=4, kv_cache_tokens=96)
    plain = _run(tiny_model_dir, prompts, 0, **kw)[0]
    spec, _, drafts, _, e = _run(tiny_model_dir, prompts, 4, **kw)
    assert spec == plain and drafts > 0 and e.preempted > 0
    assert e.blocks.num_used_blocks == 0  # every block came back


def test_grammar_and_logprobs_rows_take_no_drafts(tiny_model_dir):
    e = NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=4, max_model_len=128, speculative_ngram=4))
    e.add("lp", [5, 6, 5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=8, logprobs=1))
    e.add("plain", [5, 6, 5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=8))
    drafted = {"lp": 0, "plain": 0}
    schedule = e.scheduler.schedule

    def watched():
        out = schedule()
        for c in out.chunks:
            drafted[c.request.request_id] += len(c.drafts)
        return out

    e.scheduler.schedule = watched
    while e.has_unfinished():
        e.step()
    assert drafted["lp"] == 0 and drafted["plain"] > 0
