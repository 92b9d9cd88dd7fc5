"""Engine behaviour on the tiny model: stopping, limits, timings, per-step records."""

import pytest

from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine import RequestRejected
from batchgen.engine.native import NativeEngine


def run_all(engine):
    steps, finished = [], {}
    while engine.has_unfinished():
        r = engine.step()
        steps.append(r)
        for f in r.finished:
            finished[f.request_id] = f
    return steps, finished


@pytest.fixture
def engine(tiny_model_dir):
    return NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=4, max_model_len=64))


def test_max_tokens_and_context_limit_end_with_length(engine):
    engine.add("short", list(range(10, 20)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add("long", list(range(10, 60)), SamplingParams(max_tokens=100, ignore_eos=True))
    _, done = run_all(engine)
    assert len(done["short"].output_token_ids) == 5 and done["short"].finish_reason == "length"
    assert 50 + len(done["long"].output_token_ids) == 64 and done["long"].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model_dir):
    e = NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=2, max_model_len=64))
    e.eos_token_ids = {None}  # find what the random model emits, then make that token the EOS
    e.add("probe", list(range(5, 15)), SamplingParams(max_tokens=6, ignore_eos=True))
    _, done = run_all(e)
    toks = done["probe"].output_token_ids
    e.eos_token_ids = {toks[2]}
    e.add("stops", list(range(5, 15)), SamplingParams(max_tokens=6))
    e.add("ignores", list(range(5, 15)), SamplingParams(max_tokens=6, ignore_eos=True))
    _, done = run_all(e)
    first = toks.index(toks[2])
    assert done["stops"].output_token_ids == toks[:first + 1] and done["stops"].finish_reason == "stop"
    assert done["ignores"].output_token_ids == toks


def test_stop_string_ends_the_request_and_is_cut_from_the_text(tiny_model_dir):
    e = NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=2, max_model_len=64))
    e.add("probe", list(range(5, 15)), SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3))
    _, done = run_all(e)
    full = done["probe"]
    assert len(full.text) >= 6, full.text
    cut = len(full.text) // 2
    stop = full.text[cut:cut + 2]
    e.add("s", list(range(5, 15)), SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3, stop=(stop,)))
    _, done = run_all(e)
    assert done["s"].finish_reason == "stop"
    assert len(done["s"].output_token_ids) < 8
    assert done["s"].text == full.text[:full.text.find(stop)]


def test_timings_are_ordered_and_steps_are_recorded(engine):
    for i in range(6):
        engine.add(f"r{i}", list(range(10, 14 + 3 * i)), SamplingParams(max_tokens=4 + i, ignore_eos=True))
    steps, done = run_all(engine)
    assert len(done) == 6
    for f in done.values():
        assert f.enqueue_t <= f.schedule_t <= f.first_token_t <= f.last_token_t
    for a, b in zip(steps, steps[1:]):
        assert a.start_t <= a.end_t <= b.start_t
    assert max(s.num_running for s in steps) == 4
    assert steps[0].num_waiting == 2 and steps[0].num_prefill_tokens > 0 and steps[0].num_decode_tokens == 0
    # one token event per running sequence per step, and context_len = prompt + outputs before it
    for s in steps:
        assert len(s.token_request_ids) == s.num_running
        assert s.sum_context_len == sum(s.token_context_lens)
        assert s.bytes_read > 0
    total = sum(len(s.token_request_ids) for s in steps)
    assert total == sum(len(f.output_token_ids) for f in done.values())


def test_seeded_sampling_is_reproducible_across_batch_composition(tiny_model_dir):
    def run(n_neighbours):
        e = NativeEngine(tiny_model_dir, EngineConfig(max_num_seqs=4, max_model_len=64))
        for i in range(n_neighbours):
            e.add(f"n{i}", list(range(30, 40 + i)), SamplingParams(max_tokens=9, temperature=1.0))
        e.add("x", list(range(10, 20)), SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
                                                         ignore_eos=True))
        return run_all(e)[1]["x"].output_token_ids

    assert run(0) == run(3)


def test_bad_requests_are_rejected_one_by_one(engine):
    with pytest.raises(RequestRejected, match="empty prompt"):
        engine.add("a", [], SamplingParams())
    with pytest.raises(RequestRejected, match="leave no room for output within max_model_len 64"):
        engine.add("b", list(range(64)), SamplingParams())
    engine.add("c", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match="duplicate"):
        engine.add("c", [5, 6, 7], SamplingParams(max_tokens=2))
    assert len(run_all(engine)[1]) == 1
