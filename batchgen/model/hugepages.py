"""The engine's big, long-lived CPU buffers (the weights, the paged KV pool) on transparent huge pages.

A decode step streams every weight and the whole KV cache. On 4 KiB pages that is a TLB miss and a
page walk every 4 KiB: 24,000 pages for a batch-1 step of SmolLM2-135M's GGUF blocks, a million for a
batch-256 step's KV. On 2 MiB pages the same bytes take 512 times fewer entries. Linux gives an
anonymous mapping huge pages where `/sys/kernel/mm/transparent_hugepage/enabled` says `always`, or
`madvise` and the mapping asked for them (MADV_HUGEPAGE, before its pages are first touched); PyTorch's
allocator asks only under THP_MEM_ALLOC_ENABLE, and never for tensors under 2 MiB, which is every one
of a batch-1 model's block matrices. So the buffers here are mappings of their own, asked for huge
pages, then filled: `arena` for the KV pool, `place_attributes` for a model's weights (one mapping for
all of them, each tensor a view into it). Where the OS has no THP (`never`, not Linux), they are plain
mappings, and nothing else changes. `backed` reads /proc/self/smaps: the bytes of a tensor that
actually sit on huge pages (the run conditions print it; the kernel may run out of free huge pages).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE = 2 << 20  # x86-64's and arm64's transparent huge page
ALIGN = 64  # each tensor of an arena starts on a cache line
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in, writable, without writing it


def mode() -> str:
    """The OS's THP mode: always, madvise or never; or unavailable (no such setting here)."""
    try:
        text = THP.read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros, its own anonymous mapping, 2 MiB aligned and asked for huge pages
    (where the OS has them), every page faulted in now rather than inside a step."""
    size = -(-max(nbytes, 1) // HUGE) * HUGE + HUGE  # a page more: the start rounded up to a huge page
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor holds the mapping open
    start = -whole.data_ptr() % HUGE
    out = whole[start:start + nbytes]
    try:
        mapping.madvise(MADV_POPULATE_WRITE, start, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    except OSError:  # an older kernel: touch every page instead (they read as zero either way)
        out.zero_()
    return out


def arena(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed tensors of these shapes and dtypes, side by side in one mapping (see `empty`)."""
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in shapes]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    buf = empty(total)
    return [buf[o:o + n].view(d).view(s) for (s, d), o, n in zip(shapes, offsets, sizes)]


def place(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of these CPU tensors in one arena (see `arena`), in order."""
    out = arena([(tuple(t.shape), t.dtype) for t in tensors])
    for dst, src in zip(out, tensors):
        dst.copy_(src)
    return out


def plain(t) -> bool:
    """A CPU tensor with bytes of its own (not oneDNN's opaque prepacked weights, which have no storage)."""
    if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided):
        return False
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def movable(t) -> bool:
    """A plain CPU tensor that is its storage's only view (so nothing else holds its bytes)."""
    return (plain(t) and not t.requires_grad and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.numel() > 0)


def place_attributes(holders: list[object]) -> int:
    """Every movable tensor held directly by these objects' attributes (a `__dict__`'s or `__slots__`')
    moved into one arena, each holder's attribute pointing at its copy (a tensor two holders share,
    e.g. a tied embedding and head, moved once). The bytes moved."""
    found = _uses(holders)
    if not found:
        return 0
    entries = list(found.values())
    for (_, uses), copy in zip(entries, place([t for t, _ in entries])):
        for h, name in uses:
            setattr(h, name, copy)
    return sum(t.numel() * t.element_size() for t, _ in entries)


def tensors_of(holders: list[object]) -> list[torch.Tensor]:
    """The CPU tensors these objects' attributes hold, each once (placed or not)."""
    return [t for t, _ in _uses(holders, plain).values()]


def _uses(holders: list[object], pick=movable) -> dict[int, tuple[torch.Tensor, list[tuple[object, str]]]]:
    found: dict[int, tuple[torch.Tensor, list[tuple[object, str]]]] = {}
    for h in holders:
        for name in _attribute_names(h):
            t = getattr(h, name, None)
            if pick(t):
                found.setdefault(id(t), (t, []))[1].append((h, name))
    return found


def _attribute_names(obj) -> list[str]:
    names = list(vars(obj)) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return names


def backed(tensors: list[torch.Tensor]) -> int:
    """Bytes of these tensors' mappings that sit on huge pages (AnonHugePages in /proc/self/smaps),
    each mapping counted once, at most the tensors' own bytes in whole huge pages; 0 where smaps
    cannot be read."""
    starts = {t.data_ptr() for t in tensors if plain(t) and t.numel()}
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    total, hit = 0, False
    for line in lines:
        head = line.split(None, 1)[0]
        if "-" in head and ":" not in head:  # a mapping's address range
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = any(lo <= p < hi for p in starts)
        elif hit and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    # the kernel merges neighbouring mappings of the same kind (two arenas) into one range: at most the tensors' own
    return min(total, sum(t.numel() * t.element_size() for t in tensors if plain(t)))
