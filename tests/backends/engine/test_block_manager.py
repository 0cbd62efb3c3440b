"""Block manager: allocation, prefix-cache hits, LRU eviction, holds and KV events."""
from __future__ import annotations

import pytest

from backends.core.block_events import KVEventKind, KVEventRing
from backends.core.block_manager import BlockManager
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import Sequence
from cache.block_hash import ROOT_HASH, block_hashes

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tuple(tokens), SamplingParams(), seed=0)


def computed(bm: BlockManager, s: Sequence, n: int | None = None) -> None:
    """Pretend the runner computed the first n (default: all) tokens."""
    s.num_computed_tokens = s.num_tokens if n is None else n
    bm.cache_computed_blocks(s)


@pytest.mark.parametrize("num_tokens, blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_covers_all_tokens(num_tokens: int, blocks: int) -> None:
    bm = BlockManager(8, BS)
    s = seq(list(range(num_tokens)))
    assert bm.allocate(s) == 0
    assert len(s.block_table) == blocks and len(set(s.block_table)) == blocks
    assert bm.num_free_blocks == 8 - blocks
    bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


@pytest.mark.parametrize("prompt_len, expected_cached", [
    (12, 8),    # 3 full blocks, last token in block 2: reuse 2 blocks
    (13, 12),   # 3 full blocks cached, last token in a 4th block
    (9, 8),
    (8, 4),     # the block holding the last token is never reused fully
    (4, 0),
])
def test_prefix_hit_never_covers_last_token(prompt_len: int, expected_cached: int) -> None:
    bm = BlockManager(16, BS)
    first = seq(list(range(100, 116)), "a")          # 4 full blocks computed and cached
    bm.allocate(first)
    computed(bm, first)
    assert bm.num_cached_blocks == 4
    second = seq(list(range(100, 100 + prompt_len)), "b")
    assert bm.allocate(second) == expected_cached
    assert second.num_computed_tokens == expected_cached
    shared = expected_cached // BS
    assert second.block_table[:shared] == first.block_table[:shared]
    assert all(bm.ref_count(b) == 2 for b in first.block_table[:shared])
    bm.check_invariants()


def test_prefix_cache_disabled_has_no_hits_or_events() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(list(range(9)), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(list(range(9)), "b")
    assert bm.allocate(b) == 0
    assert bm.num_cached_blocks == 0 and bm.events.last_seq_no == 0


def test_unreferenced_cached_blocks_stay_until_needed_then_lru_evicts() -> None:
    events = KVEventRing(100)
    bm = BlockManager(4, BS, events=events)
    a = seq(list(range(8)), "a")                # 2 full blocks
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # A hit on a freed cached block revives it from the LRU.
    again = seq([*range(8), 99], "again")
    assert bm.allocate(again) == 8
    assert bm.num_free_blocks == 1
    bm.free(again)
    # Fill the cache with unrelated tokens: the cached blocks are evicted, tail block first.
    other = seq(list(range(50, 66)), "other")
    assert bm.allocate(other) == 0
    assert bm.num_cached_blocks == 0
    removed = [e for e in events.since(0).events if e.kind is KVEventKind.REMOVED]
    hashes = block_hashes(list(range(8)), BS)
    assert [e.block_hash for e in removed] == [hashes[1], hashes[0]]
    bm.check_invariants()


def test_stored_events_carry_chain_and_blocks_cache_as_decode_fills_them() -> None:
    events = KVEventRing(100)
    bm = BlockManager(8, BS, events=events)
    s = seq([1, 2, 3], "s")
    bm.allocate(s)
    computed(bm, s)
    assert events.last_seq_no == 0                # no full block yet
    for tok in (4, 5, 6, 7, 8):                   # decode: each step runs the last sampled token
        s.append_token(tok)
        assert bm.append_slots(s, 1)
        computed(bm, s, s.num_tokens)
    batch = events.since(0)
    hashes = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert [(e.kind, e.block_hash, e.parent_hash, e.num_tokens) for e in batch.events] == [
        (KVEventKind.STORED, hashes[0], ROOT_HASH, BS), (KVEventKind.STORED, hashes[1], hashes[0], BS)]
    assert [e.seq_no for e in batch.events] == [1, 2] and batch.next_since == 2 and not batch.reset
    assert len(s.block_table) == 2


def test_duplicate_computation_keeps_first_block_cached() -> None:
    bm = BlockManager(8, BS)
    a, b = seq(list(range(5)), "a"), seq(list(range(5)), "b")
    bm.allocate(a)
    bm.allocate(b)                                 # nothing cached yet: no hit
    computed(bm, a)
    computed(bm, b)
    assert bm.num_cached_blocks == 1 and bm.events.last_seq_no == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocate_refuses_below_watermark_without_side_effects() -> None:
    bm = BlockManager(4, BS)
    s = seq(list(range(12)))                       # 3 blocks
    assert not bm.can_allocate(s, watermark_blocks=2)
    assert bm.allocate(s, watermark_blocks=2) is None
    assert s.block_table == [] and bm.num_free_blocks == 4
    assert bm.allocate(s, watermark_blocks=1) == 0


def test_append_slots_fails_when_pool_empty() -> None:
    bm = BlockManager(2, BS)
    s = seq(list(range(8)))
    bm.allocate(s)
    computed(bm, s)
    s.append_token(1)
    assert not bm.can_append_slots(s, 1) and not bm.append_slots(s, 1)
    assert len(s.block_table) == 2


def test_hold_pins_blocks_until_release() -> None:
    bm = BlockManager(4, BS)
    s = seq(list(range(6)))
    bm.allocate(s)
    computed(bm, s)
    table = list(s.block_table)
    handle = bm.hold(s)
    assert s.block_table == [] and bm.held_blocks(handle) == tuple(table)
    assert bm.num_free_blocks == 2
    assert bm.release(handle) and not bm.release(handle)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 1
    bm.check_invariants()


@pytest.mark.parametrize("since, limit, expect_ids, next_since, reset", [
    (0, 10, [3, 4, 5], 5, True),     # 1..2 fell off a ring of 3: resync from the oldest kept
    (2, 10, [3, 4, 5], 5, False),
    (3, 1, [4], 4, False),
    (5, 10, [], 5, False),           # up to date
    (9, 2, [3, 4], 4, True),         # from the future (another engine incarnation): resync
])
def test_event_ring_resume_and_reset(since: int, limit: int, expect_ids: list[int], next_since: int,
                                     reset: bool) -> None:
    ring = KVEventRing(3)
    for h in range(5):
        ring.append(KVEventKind.STORED, h, ROOT_HASH, BS)
    batch = ring.since(since, limit)
    assert [e.seq_no for e in batch.events] == expect_ids
    assert (batch.next_since, batch.reset) == (next_since, reset)
