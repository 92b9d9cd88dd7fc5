"""What a step's attention reads, planned on the host by the model runner and read by every backend
(batchgen.engine.attention's PyTorch path, batchgen.engine.attention_flashinfer's kernel): the query
tiles of each width, the key tiles each pairs with, and the per-chunk lengths a kernel plans from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PREFILL_TILE = 64  # query tokens per prefill tile
DECODE_KEYS = 64  # key positions per decode pair (rounded to whole blocks)
PREFILL_KEYS = 256  # key positions per prefill pair
FAR = 1 << 40  # the position of a padding query row: it may see every key (finite, then discarded)


@dataclass
class TileGroup:
    """Query tiles of one width, and the (query tile, key tile) pairs they attend over."""

    token_idx: torch.Tensor  # [N, Qt] indices into the step's tokens (padding rows point at token 0)
    q_pos: torch.Tensor  # [N, Qt] each query's position (FAR for padding rows)
    valid: torch.Tensor | None  # [N, Qt] bool, None when no row is padding (decode)
    pair_tile: torch.Tensor  # [P]
    pair_blocks: torch.Tensor  # [P, KT] the key tile's blocks (past the sequence's end: any block, masked)
    pair_pos0: torch.Tensor  # [P] the position of the key tile's first slot


@dataclass
class AttentionMetadata:
    decode: TileGroup | None
    prefill: TileGroup | None
    verify: TileGroup | None  # speculative chunks: the newest token and its drafts, a tile of 1 + k
    # per scheduled chunk, for kernels that plan from sequence lengths (FlashInfer)
    q_lens: list[int]  # tokens computed this step
    seq_lens: list[int]  # context length after this step
    block_tables: list[list[int]]
