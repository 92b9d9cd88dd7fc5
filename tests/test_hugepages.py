"""The engine's big CPU buffers on transparent huge pages (batchgen.model.hugepages): arenas that are
zeroed, aligned and apart; tensors moved into one with their values and their sharing kept; the OS's
own account (/proc/self/smaps) that they sit on huge pages where it offers them; and the engine's real
path, which makes the same tokens either way and says in its conditions how much was placed."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen.config import SamplingParams
from batchgen.model import hugepages
from conftest import engine_tokens


def thp_fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def test_an_arena_holds_zeroed_aligned_tensors_apart():
    shapes = [((5, 3, 16, 64), torch.float32), ((7,), torch.float16), ((3, 33), torch.int8), ((2, 2), torch.bfloat16)]
    got = hugepages.arena(shapes)
    assert [(tuple(t.shape), t.dtype) for t in got] == shapes
    assert all(t.data_ptr() % hugepages.ALIGN == 0 and t.is_contiguous() and not t.any() for t in got)
    assert got[0].data_ptr() % hugepages.HUGE == 0  # the mapping starts on a huge page
    for i, t in enumerate(got):
        t.fill_(i + 1)
    assert [t.float().unique().tolist() for t in got] == [[1.0], [2.0], [3.0], [4.0]]  # no tensor overlaps another


def test_moved_tensors_keep_their_values_and_sharing():
    class Holder:
        __slots__ = ("w", "b")

    class Model:
        pass

    tied, bias, other = torch.randn(300, 64), torch.randn(64), torch.randn(10, 10)
    m, lin = Model(), Holder()
    m.embed, m.head_view, m.count = tied, other[2:], 3  # a view of another's storage stays where it is
    m.strided = other.t()  # not contiguous: stays
    lin.w, lin.b = tied, bias  # the same tensor as the model's embedding
    before = {k: v.clone() for k, v in [("tied", tied), ("bias", bias)]}
    moved = hugepages.place_attributes([m, lin])
    assert moved == tied.nbytes + bias.nbytes
    assert m.embed is lin.w and m.embed.data_ptr() != tied.data_ptr()  # moved once, both holders see the copy
    assert torch.equal(m.embed, before["tied"]) and torch.equal(lin.b, before["bias"])
    assert m.head_view.data_ptr() == other[2:].data_ptr() and m.strided.data_ptr() == other.data_ptr()
    assert m.count == 3
    assert hugepages.place_attributes([m, lin]) == 0  # views into the arena now: nothing moves twice
    assert {t.data_ptr() for t in hugepages.tensors_of([m, lin])} >= {m.embed.data_ptr(), lin.b.data_ptr()}


@pytest.mark.skipif(hugepages.mode() not in ("always", "madvise"), reason="this OS offers no transparent huge pages")
def test_the_os_puts_an_arena_on_huge_pages():
    fallbacks = thp_fallbacks()
    (t,) = hugepages.arena([((8 << 20,), torch.uint8)])
    got = hugepages.backed([t])
    if got == 0 and thp_fallbacks() > fallbacks:
        pytest.skip("the kernel had no free huge page for this mapping (thp_fault_fallback rose)")
    assert got == t.nbytes  # 8 MiB from a huge-page boundary: all of it on huge pages
    # torch's allocator does not ask: in a fresh process, since in this one (the whole suite's, after
    # engines, vLLM and the arenas of other tests) a plain 8 MiB tensor once read as all on huge pages
    code = ("import torch; from batchgen.model import hugepages; "
            "p = torch.zeros(8 << 20, dtype=torch.uint8); print(hugepages.backed([p]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 8 << 20 or hugepages.mode() == "always"


def test_the_engine_makes_the_same_tokens_on_huge_pages(tiny_model_dir):
    prompts = ["The capital of France is", "List three colours:", "1, 2, 3,"]
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    on, cond_on = engine_tokens(tiny_model_dir, prompts, p, max_num_seqs=2, huge_pages=True)
    off, cond_off = engine_tokens(tiny_model_dir, prompts, p, max_num_seqs=2, huge_pages=False)
    assert on == off and len(on) == 3
    assert cond_off["huge_pages"].startswith("off")
    assert cond_on["huge_pages"].startswith(f"THP {hugepages.mode()}: weights ")
    assert "KV pool" in cond_on["huge_pages"]
