"""The decode step with static shapes: captured once per bucket as a CUDA graph, replayed each step.

A decode step launches hundreds of small kernels (per layer: norms, RoPE, the KV write, attention,
matmuls); on a GPU at small batch the launches, not the memory reads, set its time. vLLM and
gpt-fast capture the step as a CUDA graph per batch-size bucket and replay it with the inputs copied
into static buffers; this does the same for the native engine's PyTorch paged path:

- a step of only decode tokens (no prompt chunk, no speculative drafts) is padded to a bucket of
  rows B (1, 2, 4, 8, ... up to max_num_seqs) and of (query tile, key tile) pairs P (a power of two):
  the graph's shapes are (B, P), and a step's inputs are copied into that bucket's static buffers;
- a padding row reads and writes only the scratch block (one KV block kept out of the pool's
  allocator), with one visible key, so it computes finite values that are then dropped; a padding
  pair is assigned to row 0 and masked whole (its first position is past every query), so it adds
  nothing to row 0's softmax;
- a bucket's graph is captured on its first use, all of them sharing one memory pool, and the
  logits come back from the graph's static output.

On CPU there is no graph to capture. There the static shapes serve torch.compile instead
(mode "compile"): Inductor compiles the whole decode step, fusing the norms, RoPE,
the KV write and the attention's gathers, masks and split softmax into a few C++ kernels around the
matmuls (batchgen's gemv kernel or oneDNN's prepacked one, called as opaque kernels,
batchgen.model.linear). The number of pairs is a dynamic size of that compile (only the attention
kernel, an opaque op, reads the pairs), so the pairs buckets of one rows bucket share its code: a
batch-1 job of 600 tokens, whose pairs pass through buckets 1 to 16, compiles once instead of 5 times,
at the same speed and with the same tokens.
The number of rows is a dynamic size too, past 1 (Dynamo specialises a size of 1): one compile serves
every rows bucket from 2 to max_num_seqs, where a batch-256 job's first run would compile each of the
32 buckets a shrinking batch passes through. The compiled step runs 1.2-1.4x the eager one at batch
1, 8 and 64 (docs/engine.md). A compile costs seconds (Dynamo traces every
layer: ~4-6 s a bucket with Inductor's cache warm, a minute or more cold), so `--compile auto` rents
before it buys: a bucket runs the dynamic (unpadded) path until the time spent there would have paid
for its compile (the compile cost measured last on this machine, over the saving, SAVING), then
compiles it; `--compile on` compiles each bucket on first use. Mode "eager" runs the padded,
static-buffer step eagerly, which is how the tests check that padding never changes a token. Steps
with a prompt chunk or drafts, and the FlashInfer backend (which plans on the host each step), run the
dynamic path.
"""

from __future__ import annotations

import hashlib
import json
import time
import types
from types import MappingProxyType
from typing import Callable

import torch

from batchgen.engine.attention_metadata import FAR, AttentionMetadata, TileGroup
from batchgen.metrics.probe import machine_record, write_record
from batchgen.model.linear import let_inductor_call_prepacked

SAVING = 0.25  # the fraction of an eager step a compiled one saves (measured 0.17-0.30, see above)
UNMEASURED_COMPILE_S = 30.0  # the compile cost assumed before one has been measured on this machine
# Inductor's generated wrapper checks every input's size, stride and alignment on each call: some 15
# Python calls a layer, some 5% of a batch-1 step. A bucket's
# inputs are its own static buffers, the weights and the KV pool: the same tensors every call, whose
# shapes and strides Dynamo's guards already check before the compiled code runs. cpp_wrapper: the
# wrapper that calls the step's kernels is C++ too, not Python (faster at batch 1 and 64, measured).
# cpp_wrapper_build_separate: that wrapper (some 5,500 lines of kernel calls for SmolLM2's 30 layers) is
# compiled at -O1 apart from the kernels (-O3), instead of all at -O3 in one file: a bucket compiles in
# about half the time, with the same tokens and speed (`python -m batchgen.benchmarks.step_ab --variants
# cpu/1s,cpu/1` measures it).


def bucket_guards(entries) -> list[bool]:
    """Which of Dynamo's guards a compiled step keeps: those on the bucket's static buffers (`st`: the
    shapes that tell the buckets apart) and the global state (grad mode, default device, ...). Those on
    the engine's own objects go: the model's ~500 weights and functions, the KV pool and the attention
    backend are set at load and fixed for the engine's life, and checking their 1,600 guards cost a
    tenth of a batch-1 step. Safe only because each DecodeGraphs
    compiles a code object of its own (own_code): Dynamo keeps compiled entries on the code object, so
    without it one engine's entry would serve another engine's model."""
    return [not e.name.startswith(("self", "type(self")) for e in entries]


def own_code(method):
    """`method` (bound) on a copy of its function's code object: a torch.compile of it keeps its entries
    apart from every other instance's (Dynamo caches on the code object, and bucket_guards no longer
    tells two engines apart), and they go with the instance."""
    fn = method.__func__
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(copy, method.__self__)


STEP_OPTIONS = MappingProxyType({"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False,
                                 "cpp_wrapper": True, "cpp_wrapper_build_separate": True,
                                 "guard_filter_fn": bucket_guards})


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def row_bucket(n: int) -> int:
    """Rows of a bucket, as vLLM sizes its graphs: 1, 2, 4, 8, then multiples of 8 (a batch of 33
    is padded to 40, not 64: padding rows cost compute at large batch)."""
    return bucket(n) if n <= 8 else -(-n // 8) * 8


class _Static:
    """One bucket's input buffers, its captured graph (CUDA) and its output."""

    def __init__(self, B: int, P: int, KT: int, device: str):
        i64 = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(B, **i64)
        self.positions = torch.zeros(B, **i64)
        self.block_idx = torch.zeros(B, **i64)
        self.offset = torch.zeros(B, **i64)
        self.logits_idx = torch.arange(B, **i64)
        self.q_pos = torch.zeros(B, 1, **i64)
        self.token_idx = torch.arange(B, **i64)[:, None]
        self.pair_tile = torch.zeros(P, **i64)
        self.pair_blocks = torch.zeros(P, KT, **i64)
        self.pair_pos0 = torch.zeros(P, **i64)
        self.meta = AttentionMetadata(
            decode=TileGroup(token_idx=self.token_idx, q_pos=self.q_pos, valid=None,
                             pair_tile=self.pair_tile, pair_blocks=self.pair_blocks, pair_pos0=self.pair_pos0),
            prefill=None, verify=None, q_lens=[1] * B, seq_lens=[1] * B, block_tables=[])
        self.graph = None  # mode capture: the CUDA graph, and its static output
        self.logits = None
        self.compiled = False  # mode compile: whether this bucket's shapes have been compiled


class DecodeGraphs:
    """mode: "capture" (CUDA graphs), "compile" (Inductor, per bucket) or "eager" (padded buckets run
    eagerly). `compile_after_s`: seconds of eager steps a bucket runs before it is compiled (0: at
    once; None: from the compile cost measured on this machine, see the module's docstring)."""

    def __init__(self, model, kv, attention, scratch_block: int, device: str, mode: str,
                 compile_after_s: float | None = 0.0, step_options: dict | None = None,
                 dynamic_pairs: bool | None = None, dynamic_rows: bool | None = None):
        self.model, self.kv, self.attention = model, kv, attention
        self.scratch = scratch_block
        self.device, self.mode = device, mode
        self.capture = mode == "capture"
        self.buckets: dict[tuple[int, int], _Static] = {}
        self.pool = None
        self.num_steps = 0  # decode steps run through a bucket (replayed, compiled, or eager)
        self.compile_s = 0.0  # seconds spent compiling buckets
        self.num_compiles = 0  # compiles of the step (a bucket's first call that Dynamo traced)
        self.auto = compile_after_s is None
        self.record = _compile_record(model)
        self.compile_after_s = (compile_after_s if compile_after_s is not None
                                else _estimated_compile_s(device, self.record) / SAVING)
        # mode compile: a bucket's number of pairs is a dynamic size of the compiled step, so one compile serves
        # every pairs bucket of its rows (the pairs are read by the attention kernel alone, an opaque op to
        # Inductor, so the compiled code does not depend on their number); buckets still differ in rows
        self.dynamic_pairs = mode == "compile" if dynamic_pairs is None else dynamic_pairs
        # and so is its number of rows, past 1 (Dynamo specialises a size of 1): one compile for buckets 2
        # to max_num_seqs (else a batch-256 job's first run compiles 32 rows buckets, minutes of start-up)
        self.dynamic_rows = self.dynamic_pairs if dynamic_rows is None else dynamic_rows
        self.eager_s: dict = {}  # seconds of dynamic steps per bucket not yet compiled (per rows, with dynamic pairs)
        self.compiled_step = None
        self.failed: str | None = None  # why a compile failed under auto (the dynamic path serves from then on)
        if mode == "compile":
            let_inductor_call_prepacked()
            # one compiled function, one specialisation per bucket: raise Dynamo's default of 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4096)
            # Inductor's options for the step (step_options: another set, for an A/B; batchgen.benchmarks.step_ab)
            self.compiled_step = torch.compile(own_code(self._step), dynamic=False,
                                               options=dict(step_options or STEP_OPTIONS))

    def run(self, tokens: list[int], positions: list[int], block_idx: list[int], pairs: tuple[list, list, list],
            kt: int, dynamic: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Logits [R, V] of a decode-only step: R rows (one token each) and their attention pairs.
        `dynamic()` runs the step unpadded (what a bucket not compiled yet runs, in mode compile)."""
        R, n_pairs = len(tokens), len(pairs[0])
        B = row_bucket(R)
        P = bucket(n_pairs + B - R)  # each padding row needs a pair of its own
        if self.dynamic_pairs:  # at least 2: Dynamo specialises a dynamic size of 1 (a compile of its own)
            P = max(P, 2)
        if self.failed:
            return dynamic()
        st = self.buckets.get((B, P))
        if st is None and self.mode == "compile" and not self._served(B):
            key = self.compile_key(B, P)
            spent = self.eager_s.get(key, 0.0)
            if spent < self.compile_after_s:  # still renting: the unpadded eager step
                t0 = time.perf_counter()
                out = dynamic()
                self.eager_s[key] = spent + time.perf_counter() - t0
                return out
        if st is None:
            st = self.buckets[(B, P)] = _Static(B, P, kt, self.device)
            if self.dynamic_pairs:
                for t in (st.pair_tile, st.pair_blocks, st.pair_pos0):
                    torch._dynamo.mark_dynamic(t, 0)
            if self.dynamic_rows and B > 1:
                for t in (st.tokens, st.positions, st.block_idx, st.offset, st.logits_idx, st.q_pos, st.token_idx):
                    torch._dynamo.mark_dynamic(t, 0)
        self._fill(st, R, tokens, positions, block_idx, pairs, kt)
        self.num_steps += 1
        if self.mode == "eager":
            return self._forward(st)[:R]
        if self.mode == "compile":
            if st.compiled:
                return self._compiled_step(st)[:R]
            # this bucket's first call compiles it (with dynamic pairs, unless its rows' code is compiled already)
            frames, t0 = torch._dynamo.utils.counters["frames"]["total"], time.perf_counter()
            try:
                out = self._compiled_step(st)
            except Exception as e:  # no C++ compiler, an Inductor bug: under auto, a run must not die of it
                if not self.auto:
                    raise
                self.failed = f"{type(e).__name__}: {str(e)[:200]}"
                return dynamic()
            took = time.perf_counter() - t0
            st.compiled = True
            if torch._dynamo.utils.counters["frames"]["total"] > frames:  # Dynamo traced, so Inductor compiled
                self.num_compiles += 1
                self.compile_s += took
                _record_compile_s(self.device, self.record, took)
            return out[:R]
        if st.graph is None:
            self._capture(st)
        st.graph.replay()
        return st.logits[:R]

    def compile_key(self, B: int, P: int):
        """What one compile serves: a (rows, pairs) bucket, a rows bucket (dynamic pairs), or every rows
        bucket past 1 (dynamic rows too)."""
        if not self.dynamic_pairs:
            return (B, P)
        return min(B, 2) if self.dynamic_rows else B

    def _served(self, B: int) -> bool:
        """Whether compiled code already serves rows bucket B."""
        return self.dynamic_pairs and any(self.compile_key(b, 0) == self.compile_key(B, 0) for b in self.compiled_rows)

    @property
    def compiled_rows(self) -> set[int]:
        """The rows buckets compiled so far (with dynamic pairs, each serves every pairs bucket of its rows)."""
        return {B for (B, _), st in self.buckets.items() if st.compiled}

    def _fill(self, st: _Static, R: int, tokens, positions, block_idx, pairs, kt: int) -> None:
        B, P = st.tokens.shape[0], st.pair_tile.shape[0]
        pad_rows, pad_pairs = B - R, P - len(pairs[0]) - (B - R)
        bs = self.kv.block_size
        # host-side assembly, then one copy per buffer (non-blocking on CUDA)
        cols = {
            st.tokens: tokens + [0] * pad_rows,
            st.positions: positions + [0] * pad_rows,
            st.block_idx: block_idx + [self.scratch] * pad_rows,
            st.offset: [p % bs for p in positions] + [0] * pad_rows,
            st.q_pos: [[p] for p in positions] + [[0]] * pad_rows,
            # a padding row attends over the scratch block from position 0 (one visible key: finite);
            # a padding pair sits on row 0 and starts past every query, so all of it is masked
            st.pair_tile: pairs[0] + list(range(R, B)) + [0] * pad_pairs,
            st.pair_blocks: pairs[1] + [[self.scratch] * kt] * (pad_rows + pad_pairs),
            st.pair_pos0: pairs[2] + [0] * pad_rows + [FAR] * pad_pairs,
        }
        for buf, values in cols.items():
            buf.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=True)

    def _step(self, st: _Static) -> torch.Tensor:
        return self.model.step(st.tokens, st.positions, self.kv, st.block_idx, st.offset, self.attention, st.meta,
                               st.logits_idx)

    def _compiled_step(self, st: _Static) -> torch.Tensor:
        with torch.no_grad():  # not inference mode: Dynamo cannot fake the inference tensors it makes
            return self.compiled_step(st)

    def _forward(self, st: _Static) -> torch.Tensor:
        return self.model.forward(st.tokens, st.positions, self.kv, st.block_idx, st.offset, self.attention,
                                  st.meta, st.logits_idx)

    def _capture(self, st: _Static) -> None:
        """Warm up on a side stream (lazy inits, autotuning), then record the step; buckets share a pool."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(st)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        st.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(st.graph, pool=self.pool):
            st.logits = self._forward(st)
        self.pool = st.graph.pool()

    def describe(self) -> str:
        if self.mode == "capture":
            return (f"decode step captured per (rows, pairs) bucket: {len(self.buckets)} graphs, "
                    f"{self.num_steps} replays")
        if self.mode == "eager":
            return "static buckets, eager (no CUDA graphs on this device)"
        when = ("once a bucket's eager steps reach " + f"{self.compile_after_s:.0f} s (compile cost over {SAVING})"
                if self.compile_after_s else "on a bucket's first use")
        per = ("rows bucket (its pairs a dynamic size)" if not self.dynamic_rows
               else "1 row and once for 2 rows or more (rows and pairs dynamic sizes)") if self.dynamic_pairs \
            else "(rows, pairs) bucket"
        return (f"no graphs; decode step compiled per {per} {when}: {self.num_compiles} compiled so far, "
                f"{self.num_steps} compiled steps")


# ---- the compile cost measured on this machine (what `--compile auto` rents against) ----------------

def _compile_record(model) -> str:
    """The machine record's name for this model's compile cost: Dynamo traces every layer, so a
    2-layer model's seconds say little about a 30-layer one's (and the weight format changes the graph)."""
    c = model.config
    shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size, str(model.dtype),
             model.weight_layout.split(" (")[0])
    return "-compile-" + hashlib.sha256(repr(shape).encode()).hexdigest()[:12]


def _estimated_compile_s(device: str, record: str) -> float:
    try:
        return float(json.loads(machine_record(record, device).read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return UNMEASURED_COMPILE_S


def _record_compile_s(device: str, record: str, seconds: float) -> None:
    write_record(machine_record(record, device),
                 {"seconds": seconds, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
