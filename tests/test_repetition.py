"""The loop rule (batchgen.engine.repetition) and `--repetition-stop`: what it fires on and what it
leaves alone, that a run made before the setting keeps its reuse keys and identity, and on the real
model, that a looping row ends with finish_reason "repetition" and the rows that do not loop are
untouched."""

import random

import pytest

from batchgen.config import SamplingParams
from batchgen.data.reuse import request_key
from batchgen.engine.repetition import MIN_SPAN, looping, repeats_needed


def test_a_single_token_must_fill_the_span():
    assert looping([7] * (MIN_SPAN - 1)) == 0
    assert looping([7] * MIN_SPAN) == 1
    assert looping([1, 2, 3] + [0] * 20) == 0  # the zeros of a long number


def test_a_sentence_must_come_back_three_times():
    rng = random.Random(0)
    sentence = [rng.randrange(1000) for _ in range(30)]
    head = [rng.randrange(1000, 2000) for _ in range(10)]
    assert repeats_needed(30) == 3
    assert looping(head + sentence * 2) == 0
    assert looping(head + sentence * 3) == 30
    assert looping(head + sentence * 3 + sentence[:5]) == 30  # still in the loop, mid-pattern


def test_a_short_pattern_needs_more_repeats():
    pattern = [5, 6, 7, 8]
    assert repeats_needed(4) == 16
    assert looping(pattern * 15) == 0
    assert looping(pattern * 16) == 4


def test_varied_text_never_fires():
    rng = random.Random(1)
    tokens = [rng.randrange(49152) for _ in range(2000)]
    assert all(looping(tokens[:n]) == 0 for n in range(1, 2000, 7))


def test_off_keeps_the_keys_of_runs_made_before_the_setting():
    """A run made before --repetition-stop existed generated as `off` does: its rows' reuse keys and its
    identity hold no such field, and a run with the stop off makes the same keys; `on` makes others."""
    off = SamplingParams(max_tokens=8, repetition_stop="off")
    on = SamplingParams(max_tokens=8)
    assert on.repetition_stop == "on"
    assert "repetition_stop" not in off.record()
    assert on.record()["repetition_stop"] == "on"
    numerics = {"model": "m"}
    # the keys the code before the setting gave for these rows (greedy; sampled with seed 3, second sample)
    assert request_key(numerics, [1, 2], off, 0) == "cb5f3c74e25dd9e79911612bfa73a3192d44631405a6c5baa036eba3113b8cd7"
    sampled = SamplingParams(max_tokens=8, temperature=0.7, seed=3, repetition_stop="off")
    assert request_key(numerics, [1, 2], sampled, 1) == \
        "e7f01a8063163bb40470435362d373f72f868d87292a425df55d8100d477df08"
    assert request_key(numerics, [1, 2], on, 0) != request_key(numerics, [1, 2], off, 0)


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="repetition_stop"):
        SamplingParams(repetition_stop="yes")


LOOPING = ("seed_task_4", "seed_task_13")  # the real model repeats a line of these from about token 80
ENDING = ("seed_task_1", "seed_task_113")  # answered in under 50 tokens


@pytest.mark.slow
def test_the_real_model_stops_a_looping_row_and_leaves_the_others(tmp_path, real_model_dir, capsys):
    """Two of the seed prompts loop under greedy decoding on SmolLM2; with the stop on (the default)
    they end as soon as the rule fires, each with the same tokens up to there as a run with it off,
    which runs them to max_tokens; the rows that end by themselves are the same in both."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.cli import main
    from batchgen.report.queries import connect, run_query

    from conftest import TEST_DATA, read_run_table

    rows = [r for r in pq.read_table(TEST_DATA / "alpaca_seed_prompts.parquet").to_pylist() if r["id"] in LOOPING + ENDING]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    base = ["generate", "--input", str(inp), "--output", str(tmp_path), "--max-tokens", "160", "--no-progress"]
    assert main([*base, "--run-id", "on"]) == 0
    assert "2 of 4 rows were stopped in a loop (finish_reason 'repetition'" in capsys.readouterr().out
    assert main([*base, "--run-id", "off", "--repetition-stop", "off"]) == 0
    on = {r["id"]: r for r in read_run_table(tmp_path / "on", "requests").to_pylist()}
    off = {r["id"]: r for r in read_run_table(tmp_path / "off", "requests").to_pylist()}
    for rid in LOOPING:
        stopped, full = on[rid]["output_token_ids"], off[rid]["output_token_ids"]
        assert on[rid]["finish_reason"] == "repetition" and off[rid]["finish_reason"] == "length"
        assert len(stopped) < 120 and full[:len(stopped)] == stopped and looping(stopped)
    for rid in ENDING:
        assert on[rid]["finish_reason"] == off[rid]["finish_reason"] == "stop"
        assert on[rid]["output_token_ids"] == off[rid]["output_token_ids"]
    (s,) = run_query(connect([str(tmp_path / "on")]), "dataset_summary").to_pylist()
    assert s["finished_repetition"] == 2 and s["finished_stop"] == 2


def test_ignore_eos_asks_for_every_token():
    assert SamplingParams().stops_loops and not SamplingParams(ignore_eos=True).stops_loops
    assert not SamplingParams(repetition_stop="off").stops_loops


def reference_looping(tokens) -> int:
    """The rule read literally: every pattern length, every position of its span."""
    n = len(tokens)
    for length in range(1, 65):
        span = length * repeats_needed(length)
        if span <= n and all(tokens[i] == tokens[i - length] for i in range(n - span + length, n)):
            return length
    return 0


def test_the_fast_check_is_the_rule():
    """`looping` tries only the lengths the last token allows (it runs after every token of every row);
    on loops, near-loops and text it gives what the rule read literally gives."""
    rng = random.Random(2)
    fired = 0
    for trial in range(600):
        if trial % 2:
            pattern = [rng.randrange(40) for _ in range(rng.randrange(1, 70))]
            tokens = [rng.randrange(40) for _ in range(rng.randrange(40))] + pattern * rng.randrange(1, 10)
        else:
            tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 260))]
        for n in range(1, len(tokens) + 1, 5):
            assert looping(tokens[:n]) == reference_looping(tokens[:n])
            fired += reference_looping(tokens[:n]) > 0
    assert fired > 100  # the comparison covered loops, not only their absence
