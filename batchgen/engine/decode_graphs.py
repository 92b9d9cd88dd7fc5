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

On CPU there is no graph to capture; `capture=False` runs the same padded, static-buffer step
eagerly, which is how the tests check that padding never changes a token. Steps with a prompt chunk
or drafts, and the FlashInfer backend (which plans on the host each step), run the dynamic path.
"""

from __future__ import annotations

import torch

from batchgen.engine.attention import _FAR, AttentionMetadata, TileGroup


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


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
        self.pair_tile = torch.zeros(P, **i64)
        self.pair_blocks = torch.zeros(P, KT, **i64)
        self.pair_pos0 = torch.zeros(P, **i64)
        self.meta = AttentionMetadata(
            decode=TileGroup(token_idx=torch.arange(B, **i64)[:, None], q_pos=self.q_pos, valid=None,
                             pair_tile=self.pair_tile, pair_blocks=self.pair_blocks, pair_pos0=self.pair_pos0),
            prefill=None, verify=None, q_lens=[1] * B, seq_lens=[1] * B, block_tables=[])
        self.graph = None
        self.logits = None


class DecodeGraphs:
    def __init__(self, model, kv, attention, scratch_block: int, device: str, capture: bool):
        self.model, self.kv, self.attention = model, kv, attention
        self.scratch = scratch_block
        self.device, self.capture = device, capture
        self.buckets: dict[tuple[int, int], _Static] = {}
        self.pool = None
        self.num_steps = 0  # decode steps run through a bucket (replayed, or eager on CPU)

    def run(self, tokens: list[int], positions: list[int], block_idx: list[int], pairs: tuple[list, list, list],
            kt: int) -> torch.Tensor:
        """Logits [R, V] of a decode-only step: R rows (one token each) and their attention pairs."""
        R, n_pairs = len(tokens), len(pairs[0])
        B = bucket(R)
        P = bucket(n_pairs + B - R)  # each padding row needs a pair of its own
        bs = self.kv.block_size
        st = self.buckets.get((B, P))
        if st is None:
            st = self.buckets[(B, P)] = _Static(B, P, kt, self.device)
        pad_rows, pad_pairs = B - R, P - n_pairs - (B - R)
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
            st.pair_pos0: pairs[2] + [0] * pad_rows + [_FAR] * pad_pairs,
        }
        for buf, values in cols.items():
            buf.copy_(torch.tensor(values, dtype=torch.int64), non_blocking=True)
        self.num_steps += 1
        if not self.capture:
            return self._forward(st)[:R]
        if st.graph is None:
            self._capture(st)
        st.graph.replay()
        return st.logits[:R]

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
