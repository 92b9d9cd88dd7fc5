"""batchgen's C++ paged attention (batchgen/kernels/attention.cpp) against the PyTorch path it replaces
on CPU, on plans built by the model runner's own tile builder: decode, prefill and verify tiles,
padding rows and pairs, sliding windows and soft caps, three dtypes. Then batch invariance, bit for
bit: a query row's result is the same alone, among others, beside its group's other query heads, and
on any number of threads. Then the engine: the same greedy tokens with either backend."""

from types import SimpleNamespace

import pytest
import torch

from batchgen import kernels
from batchgen.engine.attention import CpuPagedAttention, _tile_attention, make_backend, resolve_backend
from batchgen.engine.attention_metadata import DECODE_KEYS, PREFILL_KEYS, PREFILL_TILE
from batchgen.engine.model_runner import _TileBuilder
from conftest import skip_or_fail

HKV, G, D, BS, BLOCKS = 2, 3, 64, 8, 96


@pytest.fixture(scope="module")
def op():
    why = kernels.load("attention")
    if why is not None:
        skip_or_fail(f"the attention kernel did not load: {why}")
    return torch.ops.batchgen_attention.paged


def plan(chunks, width, keys, seed=0, bs=BS):
    """A tile group over `chunks` [(start, num_tokens)], each with shuffled blocks (the caches are only
    read, so chunks may share blocks), and the step's token count."""
    gen = torch.Generator().manual_seed(seed)
    b, base = _TileBuilder(width), 0
    for start, n in chunks:
        nb = (start + n - 1) // bs + 1
        table = torch.randperm(BLOCKS, generator=gen)[:nb].tolist()
        b.add(SimpleNamespace(start=start, num_tokens=n), base, table, bs, max(1, keys // bs))
        base += n
    return b.group({"dtype": torch.long, "device": "cpu"}), base


def tensors(T, dtype, seed=1, bs=BS):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HKV, G, D, generator=gen).to(dtype)
    k = torch.randn(BLOCKS, HKV, bs, D, generator=gen).to(dtype)
    v = torch.randn(BLOCKS, HKV, bs, D, generator=gen).to(dtype)
    return q, k, v


def both(op, g, q, k, v, window=None, softcap=None):
    """(kernel, PyTorch path) on the group's valid rows."""
    qt = q[g.token_idx]
    got = op(qt, k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, D ** -0.5, window or 0, softcap or 0.0)
    ref = _tile_attention(qt, g, k, v, D ** -0.5, window, softcap)
    if g.valid is not None:
        got, ref = got[g.valid], ref[g.valid]
    return got, ref


CASES = {
    "decode": ([(c, 1) for c in (0, 7, 8, 63, 64, 200, 301)], 1, DECODE_KEYS),
    "prefill": ([(0, 150), (0, 3), (40, 90), (0, 64)], PREFILL_TILE, PREFILL_KEYS),
    "verify": ([(20, 4), (99, 4), (0, 4)], 4, DECODE_KEYS),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_kernel_matches_the_pytorch_path(op, case, dtype, tol):
    chunks, width, keys = CASES[case]
    g, T = plan(chunks, width, keys)
    q, k, v = tensors(T, dtype)
    got, ref = both(op, g, q, k, v)
    assert got.dtype == dtype and got.shape == ref.shape
    # the PyTorch path rounds scores and weights to a low-precision dtype where the kernel keeps float32
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("case", CASES)
def test_bfloat16_on_other_block_sizes_matches_float32(op, case, bs):
    """bfloat16 caches (on AVX512_BF16, the pair path: groups of 32 positions over blocks of 16, or
    within blocks of 64) against the PyTorch path in float32 on the same bfloat16 values: within
    bfloat16's rounding of the output and of the weights; closer than the PyTorch path in bfloat16."""
    chunks, width, keys = CASES[case]
    g, T = plan(chunks, width, keys, bs=bs)
    q, k, v = tensors(T, torch.bfloat16, bs=bs)
    got, _ = both(op, g, q, k, v)
    bf16 = _tile_attention(q[g.token_idx], g, k, v, D ** -0.5)
    ref = _tile_attention(q[g.token_idx].float(), g, k.float(), v.float(), D ** -0.5)
    if g.valid is not None:
        bf16, ref = bf16[g.valid], ref[g.valid]
    err = (got.float() - ref).abs().max().item()
    assert err < 2e-2 and err <= (bf16.float() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_attention_is_the_same_in_a_decode_step_a_prompt_chunk_and_a_verify_tile(op, dtype):
    """One token at position 200 (blocks of 16): as a decode row, as a prompt chunk's row (its own tile
    of 64 rows, beside other prompts), and inside a speculative-verify tile: bit for bit the same
    (a preempted sequence recomputes its tokens as a prompt, and must write the same KV)."""
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(BLOCKS, HKV, 16, D, generator=gen).to(dtype)
    v = torch.randn(BLOCKS, HKV, 16, D, generator=gen).to(dtype)
    row = torch.randn(1, HKV, G, D, generator=gen).to(dtype)
    table = torch.randperm(BLOCKS, generator=gen)[:13].tolist()  # positions 0..207
    outs = []
    for width, keys, start, n in [(1, DECODE_KEYS, 200, 1), (PREFILL_TILE, PREFILL_KEYS, 150, 51), (4, DECODE_KEYS, 198, 4)]:
        b = _TileBuilder(width)
        b.add(SimpleNamespace(start=7, num_tokens=30), 0, torch.randperm(BLOCKS, generator=gen)[:3].tolist(), 16,
              max(1, keys // 16))  # another request's chunk first
        b.add(SimpleNamespace(start=start, num_tokens=n), 30, table, 16, max(1, keys // 16))
        g = b.group({"dtype": torch.long, "device": "cpu"})
        q = torch.randn(30 + n, HKV, G, D, generator=gen).to(dtype)
        at = 30 + (200 - start)  # the token at position 200
        q[at] = row[0]
        out = op(q[g.token_idx], k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, 0.125, 0, 0.0)
        where = (g.token_idx == at) & (g.valid if g.valid is not None else True)
        outs.append(out[where][0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_bfloat16_on_amx_tiles_and_on_dot_products(op):
    """bfloat16 caches on a CPU with AMX take tiles for both products, for every row (`paged` and the
    engine's `paged_step`; `paged_on` with amx=1); amx=0 keeps VDPBF16PS. Each path, against the
    PyTorch path in float32 on the same values: within bfloat16's rounding; and each keeps a token's
    bits the same as a decode row, in a prompt chunk and in a verify tile. (On a CPU without AMX both
    calls run VDPBF16PS.)"""
    isa, on = torch.ops.batchgen_attention.bf16_isa(), torch.ops.batchgen_attention.paged_on
    assert isa in ("amx", "avx512-bf16", "vector")
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(BLOCKS, HKV, 16, D, generator=gen).bfloat16()
    v = torch.randn(BLOCKS, HKV, 16, D, generator=gen).bfloat16()
    row = torch.randn(1, HKV, G, D, generator=gen).bfloat16()
    table = torch.randperm(BLOCKS, generator=gen)[:13].tolist()  # positions 0..207
    results = {}
    for amx in (1, 0):
        for case, (chunks, width, keys) in CASES.items():
            g, T = plan(chunks, width, keys, bs=16)
            qt = tensors(T, torch.bfloat16, bs=16)[0][g.token_idx]
            got = on(qt, k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, D ** -0.5, 0, 0.0, amx)
            ref = _tile_attention(qt.float(), g, k.float(), v.float(), D ** -0.5)
            if g.valid is not None:
                got, ref = got[g.valid], ref[g.valid]
            assert (got.float() - ref).abs().max().item() < 2e-2, (amx, case)
            results[amx, case] = got
            if amx:  # the default op is this path
                plain = op(qt, k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, D ** -0.5, 0, 0.0)
                assert torch.equal(plain[g.valid] if g.valid is not None else plain, got)
        outs = []
        for width, keys, start, n in [(1, DECODE_KEYS, 200, 1), (PREFILL_TILE, PREFILL_KEYS, 150, 51),
                                      (4, DECODE_KEYS, 198, 4)]:
            b = _TileBuilder(width)
            b.add(SimpleNamespace(start=n, num_tokens=30), 0, table[:3], 16, max(1, keys // 16))
            b.add(SimpleNamespace(start=start, num_tokens=n), 30, table, 16, max(1, keys // 16))
            g = b.group({"dtype": torch.long, "device": "cpu"})
            q = torch.randn(30 + n, HKV, G, D, generator=gen).bfloat16()
            at = 30 + (200 - start)
            q[at] = row[0]
            out = on(q[g.token_idx], k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, 0.125, 0, 0.0, amx)
            outs.append(out[(g.token_idx == at) & (g.valid if g.valid is not None else True)][0])
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), amx
    if isa == "amx":  # two instruction sets: close, but not rounded alike
        assert any(not torch.equal(results[1, c], results[0, c]) for c in CASES)
        for c in CASES:
            torch.testing.assert_close(results[1, c].float(), results[0, c].float(), atol=2e-2, rtol=2e-2)


def test_bfloat16_reads_no_slot_past_the_tiles_last_position(op):
    """The pair path packs whole groups of 32 positions: the slots past the last query's position (here
    the rest of a block whose tail holds NaN, and the pair's unused blocks) must be neither read
    into a weight nor into the output."""
    g, T = plan([(0, 20)], PREFILL_TILE, PREFILL_KEYS, bs=16)  # positions 0..19: block 0 whole, block 1 part
    q, k, v = tensors(T, torch.bfloat16, bs=16)
    clean = op(q[g.token_idx], k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, D ** -0.5, 0, 0.0)
    blocks = g.pair_blocks[0].tolist()
    k[blocks[1], :, 4:], v[blocks[1], :, 4:] = float("nan"), float("nan")  # slots 20..31
    poison = next(b for b in range(BLOCKS) if b not in blocks[:2])
    g.pair_blocks[0, 2:] = poison
    k[poison], v[poison] = float("nan"), float("nan")
    out = op(q[g.token_idx], k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, D ** -0.5, 0, 0.0)
    assert torch.equal(out, clean) and not out.isnan().any()


@pytest.mark.parametrize("dims,bs", [(40, 8), (64, 12), (24, 48), (32, 16), (128, 16)])
def test_float32_on_shapes_outside_the_keys_in_lanes_path(op, dims, bs):
    """float32 takes the keys-in-lanes path only for D a multiple of 16 (AVX2) or 64 (AVX-512) and
    groups of 32 positions that blocks tile; other head sizes and block sizes take the fold (or its
    scalar form) and still match the PyTorch path, in every case (D = 32: the fold on AVX-512, keys in
    lanes on AVX2; D = 128: two passes of the values on either)."""
    gen = torch.Generator().manual_seed(dims + bs)
    for chunks, width, keys in CASES.values():
        g, T = plan(chunks, width, keys, bs=bs)
        q = torch.randn(T, HKV, G, dims, generator=gen)[g.token_idx]
        k = torch.randn(BLOCKS, HKV, bs, dims, generator=gen)
        v = torch.randn(BLOCKS, HKV, bs, dims, generator=gen)
        got = op(q, k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, dims ** -0.5, 0, 0.0)
        ref = _tile_attention(q, g, k, v, dims ** -0.5)
        if g.valid is not None:
            got, ref = got[g.valid], ref[g.valid]
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bs", [8, 16, 32, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_decode_across_many_key_groups_on_block_sizes(op, bs, dtype, tol):
    """A decode tile asks for its next key group's lines (float32 on AVX2, bfloat16 on AVX512_BF16), or
    its next block's (the generic fold: float32 on AVX-512, float16), while it folds the one before
    (Ahead): contexts of up to 22 groups of 32 positions, on blocks smaller than a group, one, and
    larger, with a task per KV head (3 rows) or per tile, every head (20 rows), match the PyTorch path."""
    for rows in (3, 20):
        chunks = [((97 * i + 31) % 700, 1) for i in range(rows)]
        g, T = plan(chunks, 1, DECODE_KEYS, seed=bs, bs=bs)
        q, k, v = tensors(T, dtype, seed=rows, bs=bs)
        got, ref = both(op, g, q, k, v)
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 3.0), (70, 50.0)])
def test_kernel_window_and_softcap(op, window, softcap):
    for chunks, width, keys in CASES.values():
        g, T = plan(chunks, width, keys)
        q, k, v = tensors(T, torch.float32)
        got, ref = both(op, g, 4 * q, k, v, window, softcap)  # 4 q: scores large enough for the cap to bite
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,bs", [(torch.float32, BS), (torch.bfloat16, 16)])
def test_a_rows_result_does_not_depend_on_its_batch_or_threads(op, dtype, bs):
    """Batch invariance: one decode row, alone or among 63 others (longer and shorter), one or two
    threads; one prompt chunk, alone or beside others in a step: bit-identical results. In bf16 on
    AVX512_BF16 (the pair path), a lone decode row is a task per KV head, a row among 63 a task per
    tile with all its heads."""
    q, k, v = tensors(64, dtype, bs=bs)
    lone, _ = plan([(137, 1)], 1, DECODE_KEYS, seed=3, bs=bs)
    crowd, _ = plan([(137, 1)] + [(7 * i, 1) for i in range(1, 64)], 1, DECODE_KEYS, seed=3, bs=bs)
    a = op(q[lone.token_idx], k, v, lone.q_pos, lone.pair_tile, lone.pair_blocks, lone.pair_pos0, 0.125, 0, 0.0)
    threads = torch.get_num_threads()
    try:
        for n in {1, threads, 2}:
            torch.set_num_threads(n)
            b = op(q[crowd.token_idx], k, v, crowd.q_pos, crowd.pair_tile, crowd.pair_blocks, crowd.pair_pos0,
                   0.125, 0, 0.0)
            assert torch.equal(a[0], b[0])
    finally:
        torch.set_num_threads(threads)
    # a prompt chunk: the same tokens, in a step alone and after another request's chunk
    lone, T = plan([(0, 100)], PREFILL_TILE, PREFILL_KEYS, seed=5, bs=bs)
    mixed, _ = plan([(0, 100), (0, 30)], PREFILL_TILE, PREFILL_KEYS, seed=5, bs=bs)
    a = op(q.repeat(2, 1, 1, 1)[lone.token_idx], k, v, lone.q_pos, lone.pair_tile, lone.pair_blocks,
           lone.pair_pos0, 0.125, 0, 0.0)
    b = op(q.repeat(3, 1, 1, 1)[mixed.token_idx], k, v, mixed.q_pos, mixed.pair_tile, mixed.pair_blocks,
           mixed.pair_pos0, 0.125, 0, 0.0)
    assert torch.equal(a[lone.valid], b[:2][lone.valid])


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_a_query_head_folded_beside_its_group_gives_its_result_alone(op, case):
    """A token's G query heads of a KV head are folded side by side (up to 4 at a time); each head's
    result is bit for bit the one it gets alone: the same heads as G KV heads of one query head each
    (the keys and values repeated per head), for G = 3 and G = 6 (folded 4 + 2)."""
    chunks, width, keys = CASES[case]
    g, T = plan(chunks, width, keys)
    for groups in (3, 6):
        gen = torch.Generator().manual_seed(groups)
        q = torch.randn(T, 1, groups, D, generator=gen)[g.token_idx]
        k = torch.randn(BLOCKS, 1, BS, D, generator=gen)
        v = torch.randn(BLOCKS, 1, BS, D, generator=gen)
        side = op(q, k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, 0.125, 0, 0.0)
        shape = q.shape
        alone = op(q.reshape(*shape[:2], groups, 1, D), k.expand(-1, groups, -1, -1), v.expand(-1, groups, -1, -1),
                   g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, 0.125, 0, 0.0)
        assert torch.equal(side, alone.reshape(shape))


def test_padding_rows_are_skipped_and_read_no_block_past_the_prompt(op):
    """A prompt shorter than its tile: the padding rows output 0, and the tile reads only the prompt's
    own blocks (the pair's unused slots point at a block of NaN, which would reach the padding rows'
    output if they were read)."""
    g, T = plan([(0, 20)], PREFILL_TILE, PREFILL_KEYS)  # one tile: 20 rows, 44 padding rows
    q, k, v = tensors(T, torch.float32)
    clean, ref = both(op, g, q, k, v)
    torch.testing.assert_close(clean, ref, atol=2e-5, rtol=2e-5)
    used = (20 - 1) // BS + 1  # the prompt's blocks; the pair's other slots are past its end
    poison = next(b for b in range(BLOCKS) if b not in set(g.pair_blocks[0, :used].tolist()))
    g.pair_blocks[0, used:] = poison
    k[poison], v[poison] = float("nan"), float("nan")
    out = op(q[g.token_idx], k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, D ** -0.5, 0, 0.0)
    assert torch.equal(out[g.valid], clean)
    assert torch.equal(out[~g.valid], torch.zeros_like(out[~g.valid]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_step_op_reads_and_writes_each_token_in_place_with_the_same_bits(op, dtype):
    """paged_step, the engine's call: a step's decode rows, prompt chunks (with padding rows) and verify
    tiles in one call on the step's q, each token's output where its query is, bit for bit what the
    tile op gives on gathered queries; padding rows (pointing at token 0) write nothing."""
    chunks = [[(c, 1) for c in (0, 63, 200)], [(0, 150), (40, 90)], [(20, 4), (99, 4)]]
    widths = [(1, DECODE_KEYS), (PREFILL_TILE, PREFILL_KEYS), (4, DECODE_KEYS)]
    groups, base = [], 0
    gen = torch.Generator().manual_seed(3)
    builders = [_TileBuilder(w) for w, _ in widths]
    for b, (w, keys), cs in zip(builders, widths, chunks):
        for start, n in cs:
            table = torch.randperm(BLOCKS, generator=gen)[:(start + n - 1) // BS + 1].tolist()
            b.add(SimpleNamespace(start=start, num_tokens=n), base, table, BS, max(1, keys // BS))
            base += n
    groups = [b.group({"dtype": torch.long, "device": "cpu"}) for b in builders]
    q, k, v = tensors(base, dtype)
    got = torch.ops.batchgen_attention.paged_step(q, k, v, *([getattr(g, f) for g in groups] for f in (
        "token_idx", "q_pos", "pair_tile", "pair_blocks", "pair_pos0")), 0.125, 0, 0.0)
    want = torch.full_like(q, float("nan"))
    for g in groups:
        o = op(q[g.token_idx], k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, 0.125, 0, 0.0)
        keep = g.valid if g.valid is not None else torch.ones_like(g.token_idx, dtype=torch.bool)
        want[g.token_idx[keep]] = o[keep]
    assert not want.isnan().any()  # the groups cover every token of the step once
    assert torch.equal(got, want)
    # the engine's backend makes this call
    meta = SimpleNamespace(decode=groups[0], prefill=groups[1], verify=groups[2])
    assert torch.equal(CpuPagedAttention()(q, k, v, meta, 0.125), want)


def test_kernel_refuses_bad_input(op):
    g, T = plan([(10, 1)], 1, DECODE_KEYS)
    q, k, v = tensors(T, torch.float32)
    args = [q[g.token_idx], k, v, g.q_pos, g.pair_tile, g.pair_blocks, g.pair_pos0, 0.125, 0, 0.0]
    bad = {
        0: (q, "must be \\[N, Qt, Hkv, G, D\\]"),
        1: (k.to(torch.bfloat16), "share a dtype"),
        2: (v[:, :1], "alike"),
        3: (g.q_pos.int(), "int64"),
        4: (g.pair_tile + 5, "pair_tile out of range"),
        5: (g.pair_blocks + BLOCKS, "pair_blocks out of range"),
    }
    for i, (value, message) in bad.items():
        with pytest.raises(RuntimeError, match=message):
            op(*[value if j == i else a for j, a in enumerate(args)])


def test_auto_resolves_to_the_kernel_on_cpu(op):
    assert resolve_backend("cpu")[0] == "cpu" and isinstance(make_backend("cpu", "cpu"), CpuPagedAttention)
    assert resolve_backend("cpu", "torch")[0] == "torch" and make_backend("torch", "cpu").name == "torch-paged"
    assert resolve_backend("cpu", "cpu")[0] == "cpu"


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: a sliding window and soft caps too
def test_engine_gives_the_same_tokens_with_either_backend(op, tmp_path, real_model_dir, model_type):
    """The native engine end to end (chunked prefill, preemption, mixed steps) on the kernel and on
    the PyTorch path: the same greedy tokens."""
    from conftest import build_tiny_model
    from test_attention_backends import greedy

    model_dir = build_tiny_model(tmp_path, real_model_dir, model_type)
    ref, _, torch_engine = greedy(model_dir, "torch")
    got, preempted, e = greedy(model_dir, "cpu")
    assert torch_engine.conditions()["attention_backend"] == "torch-paged"
    assert e.conditions()["attention_backend"] == "cpu-paged"
    assert got == ref and len(got) == 5 and preempted > 0


def test_without_a_compiler_auto_takes_the_pytorch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert resolve_backend("cpu")[0] == "torch"
    with pytest.raises(RuntimeError, match="attention kernel is unavailable here"):
        resolve_backend("cpu", "cpu")


def test_a_failed_build_is_recorded_and_not_retried(tmp_path):
    """A compiler that fails: load() says why, leaves the reason beside where the library would be,
    and neither this process nor the next runs that build again (a fresh process: one that has
    loaded no kernel)."""
    import subprocess
    import sys

    calls = tmp_path / "calls"
    cxx = tmp_path / "bad-c++"
    cxx.write_text(f"#!/bin/sh\necho called >> {calls}\necho 'error: no such thing' >&2\nexit 1\n")
    cxx.chmod(0o755)
    env = {**__import__("os").environ, "CXX": str(cxx), "BATCHGEN_KERNEL_DIR": str(tmp_path / "k")}
    code = "from batchgen import kernels; print(kernels.load('attention')); print(kernels.load('attention'))"
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        lines = out.stdout.splitlines()
        assert len(lines) == 2 and lines[0] == lines[1] and "build failed: error: no such thing" in lines[0], out
    assert calls.read_text().splitlines() == ["called"]  # built once, in the first process; then the record
    assert [p.suffix for p in (tmp_path / "k").iterdir()] == [".failed"]


def test_the_op_benchmark_times_the_kernel_and_the_pytorch_path(op, capsys):
    """`python -m batchgen.benchmarks.attention_op`: both paths timed in one run, on the engine's own
    plan, with the FLOPs counted from the contexts; the table and its conditions printed."""
    from batchgen.benchmarks import attention_op

    m = attention_op.measure("decode", torch.bfloat16, 3, 300, layers=1, repeats=1)
    assert m["rows"] == 3 and 150 <= m["mean_context"] <= 560 and m["kernel"] > 0 and m["torch"] > 0
    assert m["flops"] == pytest.approx(4 * 3 * m["mean_context"] * 3 * 3 * 64)  # 3 rows of their contexts, 9 query heads
    m = attention_op.measure("prefill", torch.float32, 3, 300, layers=1, repeats=1)
    assert m["tokens"] == 300 and m["kernel"] > 0
    assert attention_op.main(["--batch", "3", "--prefill-tokens", "300", "--layers", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("decode", "prefill"))]
    assert "torch threads" in out and len(rows) == 2 and all(line.endswith("x") for line in rows)
