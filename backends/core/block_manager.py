"""Paged KV block accounting: ref-counted blocks, the prefix cache (chained block hashes, LRU of
unreferenced cached blocks) and KV events. Pure Python; never touches a KV tensor.

A block is in exactly one of: the free list (ref 0, no hash), the LRU (ref 0, cached hash),
or in use (ref > 0, cached hash or not). Blocks may also be held under a handle (disaggregated
prefill: the KV stays pinned until a decode worker has pulled it).
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Protocol, runtime_checkable

from backends.core.block_events import KVEventKind, KVEventRing
from backends.core.sequence import Sequence


@runtime_checkable
class BlockObserver(Protocol):
    """Told of cached blocks' comings and goings while their KV is still in place (the KV tiers). A KV
    connector that is one is installed as the block manager's observer (backends/engine/engine.py)."""

    def block_cached(self, block_id: int, block_hash: int) -> None:
        """The block's KV was computed and it is now reusable under block_hash."""
        ...

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        """The block is about to be reused for other KV; its content is still intact."""
        ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventRing | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events if events is not None else KVEventRing(10_000)
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()   # evictable cached blocks, oldest first
        self._hash_to_block: dict[int, int] = {}
        self._held: dict[int, list[int]] = {}
        self._next_handle = 1
        self.observer: BlockObserver | None = None

    # --- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks available for new KV: never used, or cached but unreferenced (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks reusable by hash, referenced or not."""
        return len(self._hash_to_block)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self._held.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # --- allocation ---------------------------------------------------------------------------
    def _lookup(self, seq: Sequence) -> list[int]:
        """Longest run of cached blocks for seq's tokens, never covering its last token."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self._hash_to_block.get(seq.block_hash(i, self.block_size))
            if block is None:
                break
            hits.append(block)
        return hits

    def _pool_cost(self, seq: Sequence, hits: list[int]) -> int:
        """Free-pool blocks an allocation takes: new blocks plus hits revived from the LRU."""
        revived = sum(1 for b in hits if self._ref[b] == 0)
        return self.blocks_needed(seq.num_tokens) - len(hits) + revived

    def can_allocate(self, seq: Sequence, watermark_blocks: int = 0) -> bool:
        return self.num_free_blocks - self._pool_cost(seq, self._lookup(seq)) >= watermark_blocks

    def allocate(self, seq: Sequence, watermark_blocks: int = 0) -> int | None:
        """Give seq blocks for all its tokens, reusing cached ones; returns the cached token count,
        or None (nothing changed) when the pool is too small."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits = self._lookup(seq)
        if self.num_free_blocks - self._pool_cost(seq, hits) < watermark_blocks:
            return None
        for block in hits:
            if self._ref[block] == 0:
                del self._lru[block]
            self._ref[block] += 1
        table = list(hits)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            table.append(self._take_free_block())
        seq.block_table = table
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        return seq.num_computed_tokens

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_missing(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's table to cover num_new_tokens past its computed ones; False if no room."""
        missing = self._num_missing(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's trailing blocks past the first `num_tokens` tokens (the slots of rejected drafts).
        Such blocks were never full of verified tokens, so none is cached or shared."""
        keep = self.blocks_needed(num_tokens)
        if len(seq.block_table) > keep:
            extra = seq.block_table[keep:]
            assert all(self._hash[b] is None and self._ref[b] == 1 for b in extra), "trimmed a shared block"
            del seq.block_table[keep:]
            self._decref(extra)

    def _num_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._lru.popitem(last=False)
            if self.observer is not None:
                self.observer.block_evicted(block, self._hash[block])  # type: ignore[arg-type]
            self._uncache(block)
        self._ref[block] = 1
        return block

    def _uncache(self, block: int) -> None:
        block_hash = self._hash[block]
        assert block_hash is not None
        self._hash[block] = None
        del self._hash_to_block[block_hash]
        self.events.append(KVEventKind.REMOVED, block_hash, None, self.block_size)

    # --- prefix cache -------------------------------------------------------------------------
    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly computed full blocks to the prefix cache (call after each step)."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not self.enable_prefix_caching:
            seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
            return
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            if self._hash[block] is not None:
                continue                                   # a prefix hit: already cached
            block_hash = seq.block_hash(i, self.block_size)
            if block_hash in self._hash_to_block:
                continue                                   # computed twice concurrently; keep the first
            self._hash[block] = block_hash
            self._hash_to_block[block_hash] = block
            self.events.append(KVEventKind.STORED, block_hash, seq.parent_hash(i, self.block_size),
                               self.block_size)
            if self.observer is not None:
                self.observer.block_cached(block, block_hash)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    # --- release ------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop seq's references; idempotent. Cached blocks go to the LRU, others to the free list."""
        self._decref(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _decref(self, blocks: list[int]) -> None:
        # Tail first, so that under LRU a chain's tail is evicted before its head.
        for block in reversed(blocks):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} ref count went negative"
            if self._ref[block] == 0:
                if self._hash[block] is not None:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    def hold(self, seq: Sequence) -> int:
        """Keep seq's blocks pinned under a new handle (seq gives them up); returns the handle."""
        self.cache_computed_blocks(seq)
        handle = self._next_handle
        self._next_handle += 1
        self._held[handle] = seq.block_table
        seq.block_table = []
        seq.num_registered_blocks = 0
        return handle

    def held_blocks(self, handle: int) -> tuple[int, ...] | None:
        blocks = self._held.get(handle)
        return None if blocks is None else tuple(blocks)

    def release(self, handle: int) -> bool:
        """Unpin held blocks; False if the handle is unknown (already released)."""
        blocks = self._held.pop(handle, None)
        if blocks is None:
            return False
        self._decref(blocks)
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests and debug builds)."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not (free & lru)
        for block in range(self.num_total_blocks):
            ref = self._ref[block]
            assert ref >= 0
            assert (ref == 0) == (block in free or block in lru), f"block {block}: ref {ref}"
            assert block not in lru or self._hash[block] is not None
            assert block not in free or self._hash[block] is None
        assert all(self._hash[b] == h for h, b in self._hash_to_block.items())
        assert sum(h is not None for h in self._hash) == len(self._hash_to_block)
        assert self.num_free_blocks + self.num_used_blocks == self.num_total_blocks
        # A held block is pinned: neither free nor leaked (its hold owns one reference).
        held = Counter(b for blocks in self._held.values() for b in blocks)
        assert all(self._ref[b] >= n for b, n in held.items()), "a held block lost its reference"
