"""The scheduler alone: hand-built requests, no torch, no model."""

from batchgen.config import SamplingParams
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler


def create_requests(n: int, num_tokens: int | list[int], max_tokens: int = 8) -> list[Request]:
    lens = num_tokens if isinstance(num_tokens, list) else [num_tokens] * n
    return [Request(f"r{i}", list(range(lens[i])), SamplingParams(max_tokens=max_tokens), seed=i, enqueue_t=0.0)
            for i in range(n)]


def make_scheduler(max_num_seqs=4, max_model_len=64, kv_budget=None, max_batched=1000):
    return Scheduler(max_num_seqs, max_model_len, kv_budget or max_num_seqs * max_model_len, max_batched)


def test_admits_up_to_max_num_seqs_into_distinct_slots():
    s = make_scheduler(max_num_seqs=3)
    for r in create_requests(5, 10):
        s.add(r)
    out = s.schedule()
    assert len(out.prefill) == 3 and out.decode == [] and out.num_waiting == 2
    assert sorted(r.slot for r in out.prefill) == [0, 1, 2]
    assert all(r.status is RequestStatus.RUNNING for r in out.prefill)


def test_finished_slot_is_refilled_on_the_next_schedule_and_others_keep_decoding():
    s = make_scheduler(max_num_seqs=2)
    reqs = create_requests(3, 10)
    for r in reqs:
        s.add(r)
    first = s.schedule()
    done = first.prefill[0]
    s.finish(done, "stop")
    nxt = s.schedule()
    assert [r.request_id for r in nxt.prefill] == ["r2"]
    assert nxt.prefill[0].slot == done.slot  # the freed row is reused
    assert [r.request_id for r in nxt.decode] == [first.prefill[1].request_id]


def test_kv_budget_bounds_admission():
    # each request reserves prompt 10 + max_tokens 8 = 18 positions; a budget of 40 holds two
    s = make_scheduler(max_num_seqs=8, kv_budget=40)
    for r in create_requests(4, 10, max_tokens=8):
        s.add(r)
    assert len(s.schedule().prefill) == 2
    assert s.kv_reserved_tokens == 36
    s.finish(s.running[0], "length")
    assert len(s.schedule().prefill) == 1


def test_reservation_is_capped_by_max_model_len():
    s = make_scheduler(max_num_seqs=2, max_model_len=20, kv_budget=40)
    for r in create_requests(2, 10, max_tokens=100):
        s.add(r)
    assert len(s.schedule().prefill) == 2  # 2 x min(110, 20) = 40 fits


def test_longest_prompts_first_so_prefill_batches_pad_little():
    s = make_scheduler(max_num_seqs=2)
    for r in create_requests(4, [3, 30, 7, 20]):
        s.add(r)
    assert [r.num_prompt_tokens for r in s.schedule().prefill] == [30, 20]


def test_prefill_token_budget_per_step_but_first_always_admitted():
    s = make_scheduler(max_num_seqs=4, max_batched=25)
    for r in create_requests(3, [30, 10, 10]):
        s.add(r)
    assert [r.num_prompt_tokens for r in s.schedule().prefill] == [30]
    assert [r.num_prompt_tokens for r in s.schedule().prefill] == [10, 10]


def test_request_that_can_never_fit_is_rejected_at_add():
    s = make_scheduler(max_num_seqs=1, max_model_len=16)
    try:
        s.add(create_requests(1, 16)[0])
    except ValueError as e:
        assert "max_model_len 16" in str(e)
    else:
        raise AssertionError("a prompt that fills the context must be refused")
    assert not s.has_unfinished()
