"""Paged KV memory bookkeeping, pure Python (no torch): nano-vllm's block manager, vLLM v1's block pool.

KV memory is a pool of `num_blocks` blocks of `block_size` positions. A running request owns a
block table: the blocks that hold its positions, in order. Blocks are allocated as the request
grows and given back when it finishes or is preempted.

Prefix caching: once a block is full and computed, it is keyed by a hash of its tokens chained
with the hash of every block before it, so equal keys mean equal whole prefixes (the tokens are
compared too, so a hash collision cannot alias). A new request takes the cached blocks of its
longest matching prefix and computes only the rest. Blocks are reference-counted; a block whose
count drops to zero keeps its key and waits in an LRU free queue, and is evicted (its key dropped)
only when a fresh block is needed and no uncached free block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence


class Sequenced(Protocol):
    """What the block manager needs of a request."""

    block_table: list[int]
    block_hashes: list[int]  # keys of the request's full, computed blocks, in order
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


class Block:
    __slots__ = ("block_id", "ref_count", "key", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.key: int | None = None  # prefix-cache key while the block is cached
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one position ({num_blocks=}, {block_size=})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count 0 blocks, eviction order first: uncached ones at the front, then cached ones from
        # least to most recently freed
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # key -> block_id

    # ---- queries ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def chain_key(parent: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent, token_ids))

    def computed_blocks(self, req: Sequenced) -> list[int]:
        """The cached blocks of the request's longest cached prefix. At least the last token is left to
        compute, since its logits give the next token."""
        if not self.enable_prefix_caching:
            return []
        tokens, bs = req.all_token_ids, self.block_size
        found, key = [], None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = self.chain_key(key, chunk)
            block_id = self._cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            found.append(block_id)
        return found

    def prefix_keys(self, token_ids: Sequence[int], max_blocks: int) -> tuple[int, ...]:
        """The cache keys of the first (at most `max_blocks`) full blocks of `token_ids`, as the cache
        would key them: what prefix-aware admission compares (computed once per request)."""
        bs, keys, key = self.block_size, [], None
        for i in range(min((len(token_ids) - 1) // bs, max_blocks)):
            key = self.chain_key(key, tuple(token_ids[i * bs:(i + 1) * bs]))
            keys.append(key)
        return tuple(keys)

    def num_cached_leading(self, keys: Sequence[int]) -> int:
        """How many of `keys` (a request's prefix_keys), from the first, are cached now: a cheap
        estimate for ordering (dict lookups; computed_blocks still checks the tokens on admission)."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for key in keys:
            if key not in self._cached:
                break
            n += 1
        return n

    # ---- allocation ---------------------------------------------------------------------------------

    def allocate_slots(self, req: Sequenced, num_new_tokens: int, computed: Sequence[int] = ()) -> bool:
        """Give the request the blocks it needs to hold `num_computed_tokens + num_new_tokens`
        positions; `computed` (from computed_blocks, on admission) are taken first and their tokens
        count as computed. Returns False, changing nothing, if the pool cannot supply them."""
        num_computed = len(computed) * self.block_size if computed else req.num_computed_tokens
        need = self.blocks_for(num_computed + num_new_tokens) - len(req.block_table) - len(computed)
        revived = sum(1 for b in computed if self.blocks[b].ref_count == 0)  # these leave the free queue
        if need + revived > len(self._free):
            return False
        for b in computed:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1
            req.block_table.append(b)
            req.block_hashes.append(block.key)
        if computed:
            req.num_computed_tokens = num_computed
        for _ in range(max(need, 0)):
            req.block_table.append(self._take_free())
        return True

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)  # the front: uncached, else least recently used
        block = self.blocks[block_id]
        if block.key is not None:  # evict it from the prefix cache
            if self._cached.get(block.key) == block_id:
                del self._cached[block.key]
            block.key, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def free(self, req: Sequenced) -> None:
        """Give back the request's blocks (tail first, so a prefix outlives its tails in the cache)."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.key is None:
                    self._free.move_to_end(block_id, last=False)  # caches nothing: reuse it first
        req.block_table.clear()
        req.block_hashes.clear()

    def cache_full_blocks(self, req: Sequenced, num_tokens: int) -> None:
        """Key the request's blocks that are full once its first `num_tokens` positions are computed,
        so that other requests can share them. The scheduler calls this for the positions that this
        step's forward pass computes: every layer writes the step's K/V before any attention reads,
        so a request admitted in the same step may already read them (as in vLLM v1). A block whose
        K/V will not be written this step is never keyed."""
        if not self.enable_prefix_caching:
            return
        tokens, bs = req.all_token_ids, self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = self.chain_key(req.block_hashes[-1] if req.block_hashes else None, chunk)
            req.block_hashes.append(key)
            block = self.blocks[req.block_table[i]]
            if block.key is None and key not in self._cached:
                block.key, block.token_ids = key, chunk
                self._cached[key] = block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (blocks in use keep their contents)."""
        self._cached.clear()
        for block in self.blocks:
            block.key, block.token_ids = None, ()
