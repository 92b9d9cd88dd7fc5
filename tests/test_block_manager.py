"""The block manager and the scheduler over it, alone: no torch, no model. Random workloads check the
invariants after every step: no block owned twice, reference counts equal to owners, nothing leaks."""

import random
from collections import Counter

import pytest

from batchgen.config import SamplingParams
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request
from batchgen.engine.scheduler import ADMISSIONS, Scheduler


def req(rid, prompt, max_tokens=8):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), seed=0, enqueue_t=0.0)


def check_invariants(bm: BlockManager, owners: list[Request]) -> None:
    refs = Counter(b for r in owners for b in r.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id}"
        assert (block.ref_count == 0) == (block.block_id in bm._free)
    for r in owners:
        assert len(set(r.block_table)) == len(r.block_table)  # a request never holds a block twice
        assert len(r.block_table) * bm.block_size >= r.num_computed_tokens
    # a block is exclusively owned unless it is a cached prefix block shared by equal prefixes
    for b, n in refs.items():
        if n > 1:
            assert bm.blocks[b].key is not None
    for key, b in bm._cached.items():
        assert bm.blocks[b].key == key


def test_allocation_grows_on_demand_and_frees_everything():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = req("a", range(5))
    assert bm.allocate_slots(r, 5) and len(r.block_table) == 2  # 5 positions -> 2 blocks, not the worst case
    r.num_computed_tokens = 5
    assert bm.allocate_slots(r, 3) and len(r.block_table) == 2  # up to 8 positions: still 2 blocks
    r.num_computed_tokens = 8
    assert bm.allocate_slots(r, 1) and len(r.block_table) == 3
    bm.free(r)
    assert bm.num_free_blocks == 10 and all(b.ref_count == 0 for b in bm.blocks)


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = req("a", range(8)), req("b", range(8))
    assert bm.allocate_slots(a, 8)
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1


def test_prefix_blocks_are_shared_reference_counted_and_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = req("a", list(range(10)))
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a, 10)  # 2 full blocks keyed
    b = req("b", list(range(8)) + [99, 98, 97])
    hit = bm.computed_blocks(b)
    assert hit == a.block_table[:2]
    assert bm.allocate_slots(b, 3, hit) and b.num_computed_tokens == 8
    assert [bm.blocks[x].ref_count for x in hit] == [2, 2]
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.computed_blocks(req("c", range(9))) == hit  # still cached
    # filling the pool evicts the uncached free blocks first, then the least recently freed cached ones
    big = req("big", range(100, 120))
    assert bm.allocate_slots(big, 20)  # 5 of 6 blocks: the tail of the cached prefix goes, its head stays
    assert bm.computed_blocks(req("c", range(9))) == hit[:1]
    check_invariants(bm, [big])


def test_a_prompt_wholly_cached_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", range(8))
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a, 8)
    assert len(bm.computed_blocks(req("b", range(8)))) == 1  # 8 tokens: block 2 holds the last token


def test_scheduler_preempts_the_newest_and_recomputes_it_later():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(bm, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    a, b = req("a", range(6), max_tokens=8), req("b", range(6), max_tokens=8)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [c.request for c in out.chunks] == [a, b]  # 2 blocks each: the pool is full
    for c in out.chunks:
        s.computed(c)
        c.request.output_token_ids.append(1)
    for _ in range(2):  # 7, 8 positions: still 2 blocks
        out = s.schedule()
        assert not out.preempted
        for c in out.chunks:
            s.computed(c)
            c.request.output_token_ids.append(1)
    out = s.schedule()  # a needs a 3rd block: b, the newest, gives its blocks back
    assert out.preempted == [b] and [c.request for c in out.chunks] == [a]
    assert b.num_computed_tokens == 0 and b.block_table == [] and list(s.waiting) == [b]
    assert b.num_preemptions == 1


def test_long_prompt_goes_in_chunks_beside_decode_tokens():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(bm, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=10)
    short, long = req("short", range(3), max_tokens=50), req("long", range(40))
    s.add(short)
    out = s.schedule()
    s.computed(out.chunks[0])
    short.output_token_ids.append(7)
    s.add(long)
    sizes = []
    while long.num_computed_tokens < 40:
        out = s.schedule()
        assert sum(c.num_tokens for c in out.chunks) <= 10
        assert out.chunks[0].request is short and out.chunks[0].is_decode  # decoding never stalls
        sizes.append(out.chunks[1].num_tokens)
        for c in out.chunks:
            s.computed(c)
        short.output_token_ids.append(7)
    assert sizes == [9, 9, 9, 9, 4] and out.chunks[1].samples


def test_request_that_can_never_fit_is_rejected_at_add():
    s = Scheduler(BlockManager(num_blocks=2, block_size=4), max_num_seqs=1, max_model_len=64,
                  max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="needs 3 KV blocks at most, the pool has 2"):
        s.add(req("a", range(4), max_tokens=6))
    with pytest.raises(ValueError, match="leave no room for output within max_model_len 64"):
        s.add(req("b", range(64)))
    assert not s.has_unfinished()


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_the_invariants_and_finish_every_request(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    bm = BlockManager(num_blocks=rng.randint(8, 40), block_size=bs, enable_prefix_caching=rng.random() < 0.8)
    s = Scheduler(bm, max_num_seqs=rng.randint(1, 6), max_model_len=64, max_num_batched_tokens=rng.randint(6, 40),
                  admission=rng.choice(ADMISSIONS), max_passes=rng.choice([None, 1, 3]))
    shared = [rng.randrange(50) for _ in range(rng.randint(0, 20))]  # a common system prompt, sometimes
    pending = []
    for i in range(rng.randint(5, 25)):
        prompt = (shared if rng.random() < 0.6 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        r = req(f"r{i}", prompt[:60], max_tokens=rng.randint(1, 12))
        try:
            s.add(r)
            pending.append(r)
        except ValueError:
            pass  # cannot ever fit this pool
    finished, steps = [], 0
    while s.has_unfinished():
        steps += 1
        assert steps < 5000, "no progress"
        out = s.schedule()
        assert sum(c.num_tokens for c in out.chunks) <= s.max_num_batched_tokens
        assert len(out.chunks) <= s.max_num_seqs
        for c in out.chunks:
            s.computed(c)
            if c.samples:
                c.request.output_token_ids.append(rng.randrange(50))
                if len(c.request.output_token_ids) >= c.request.sampling.max_tokens:
                    s.finish(c.request, "length")
                    finished.append(c.request)
        check_invariants(bm, s.running)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in pending)
    assert all(len(r.output_token_ids) == r.sampling.max_tokens for r in finished)
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaks
    assert all(b.ref_count == 0 for b in bm.blocks)


def run_to_end(s: Scheduler) -> list[str]:
    """Step the scheduler with one output token per sampled chunk; the order requests were admitted in."""
    admitted = []
    while s.has_unfinished():
        out = s.schedule()
        for c in out.chunks:
            if c.start == c.request.num_cached_tokens and c.request.request_id not in admitted:
                admitted.append(c.request.request_id)
            s.computed(c)
            if c.samples:
                c.request.output_token_ids.append(99)
                if len(c.request.output_token_ids) >= c.request.sampling.max_tokens:
                    s.finish(c.request, "length")
    return admitted


def grouped_workload(admission: str, max_passes: int | None = None) -> tuple[Scheduler, list[str]]:
    """Rows with one of two 16-token system prompts (P, Q) in alternating order, one row at a time, in a
    pool that holds one prompt's blocks and little more: which row goes next decides the cache hits."""
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_num_seqs=1, max_model_len=64, max_num_batched_tokens=64, admission=admission,
                  max_passes=max_passes)
    system = {"P": list(range(16)), "Q": list(range(100, 116))}
    for i, g in enumerate("PQPQPQ"):
        s.add(req(f"{g}{i}", system[g] + [200 + i, 201 + i], max_tokens=2))
    return s, run_to_end(s)


def test_prefix_admission_takes_rows_whose_prefix_is_cached_first():
    s, order = grouped_workload("prefix")
    assert order == ["P0", "P2", "P4", "Q1", "Q3", "Q5"]  # grouped by system prompt, oldest first within
    _, fifo = grouped_workload("fifo")
    assert fifo == ["P0", "Q1", "P2", "Q3", "P4", "Q5"]  # as they came


def test_prefix_admission_is_bounded():
    """A row passed over max_passes times goes next, cached prefix or not."""
    _, order = grouped_workload("prefix", max_passes=1)
    # Q1 is passed over once (P2), then goes; then Q's prefix is the cached one, and P4 waits one row
    assert order == ["P0", "P2", "Q1", "Q3", "Q5", "P4"]


def test_prefix_admission_computes_fewer_prompt_tokens():
    def computed(admission):
        bm = BlockManager(num_blocks=12, block_size=4)
        s = Scheduler(bm, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, admission=admission)
        rng = random.Random(0)
        systems = [[rng.randrange(1000) for _ in range(16)] for _ in range(3)]
        for i in range(30):
            s.add(req(f"r{i}", systems[rng.randrange(3)] + [rng.randrange(1000) for _ in range(3)], max_tokens=2))
        total = 0
        while s.has_unfinished():
            out = s.schedule()
            total += out.num_prefill_tokens
            for c in out.chunks:
                s.computed(c)
                if c.samples:
                    c.request.output_token_ids.append(99)
                    if len(c.request.output_token_ids) >= 2:
                        s.finish(c.request, "length")
        return total

    assert computed("prefix") < 0.8 * computed("fifo")


def length_workload(admission: str, max_passes: int | None = None) -> list[str]:
    """Rows allowed 2, 9, 4, 9, 2 output tokens, two at a time."""
    s = Scheduler(BlockManager(num_blocks=40, block_size=4), max_num_seqs=2, max_model_len=64,
                  max_num_batched_tokens=64, admission=admission, max_passes=max_passes)
    for i, n in enumerate([2, 9, 4, 9, 2]):
        s.add(req(f"r{i}-{n}", [i, i + 1, i + 2], max_tokens=n))
    return run_to_end(s)


def test_length_admission_takes_the_longest_rows_first_and_is_bounded():
    assert length_workload("fifo") == ["r0-2", "r1-9", "r2-4", "r3-9", "r4-2"]
    assert length_workload("length") == ["r1-9", "r3-9", "r2-4", "r0-2", "r4-2"]  # longest first, oldest among equals
    # bounded: a row passed over once goes next
    assert length_workload("length", max_passes=1) == ["r1-9", "r0-2", "r3-9", "r2-4", "r4-2"]
    _, order = grouped_workload("prefix-length")  # equal lengths: prefix admission's order
    assert order == ["P0", "P2", "P4", "Q1", "Q3", "Q5"]
    s = Scheduler(BlockManager(num_blocks=20, block_size=4), max_num_seqs=1, max_model_len=64,
                  max_num_batched_tokens=64, admission="prefix-length")
    system = list(range(16))
    s.add(req("a", system + [50], max_tokens=2))
    for c in s.schedule().chunks:  # "a" runs alone: its system prompt's blocks are now cached
        s.computed(c)
    s.add(req("short-cached", system + [51], max_tokens=2))
    s.add(req("long-uncached", list(range(100, 117)), max_tokens=8))
    assert run_to_end(s) == ["short-cached", "long-uncached"]  # a cached prefix outranks length
    s = Scheduler(BlockManager(num_blocks=20, block_size=4), max_num_seqs=1, max_model_len=64,
                  max_num_batched_tokens=64, admission="length")
    for name, n in (("a", 2), ("short", 2), ("long", 8)):
        s.add(req(name, system + [len(name)], max_tokens=n))
    assert run_to_end(s) == ["long", "a", "short"]

