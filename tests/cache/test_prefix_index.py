"""PrefixIndex against a plain reference model (a bounded LRU list per endpoint, the leading run
counted naively), plus event parsing, reset, duplicate delivery and memory bounds."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from cache.block_hash import block_hashes
from cache.prefix_index import KvEvent, KvEventBatch, KvEventType, PrefixIndex

ENDPOINTS = ("a", "b", "c")


def stored(seq: int, h: int, parent: int | None = None) -> dict:
    return {"seq": seq, "type": "stored", "block_hash": h, "parent_hash": parent}


def removed(seq: int, h: int) -> dict:
    return {"seq": seq, "type": "removed", "block_hash": h, "parent_hash": None}


def test_leading_run_only() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(0, 1), stored(1, 3), stored(2, 4)])
    assert index.num_matched_blocks("a", [1, 2, 3, 4]) == 1  # 2 missing: 3 and 4 are useless
    assert index.num_matched_blocks("a", [2, 3, 4]) == 0
    assert index.num_matched_blocks("a", [1]) == 1
    assert index.num_matched_blocks("a", []) == 0
    assert index.num_matched_blocks("zz", [1]) == 0
    index.apply("b", [stored(0, 1), stored(1, 2), stored(2, 3)])
    assert index.matched_blocks([1, 2, 3, 4]) == {"a": 1, "b": 3}
    assert index.matched_blocks([9, 1]) == {}


def test_real_prompt_hashes_share_a_prefix() -> None:
    index = PrefixIndex()
    system = list(range(100, 164))  # 4 blocks of 16 shared by both prompts
    first = block_hashes(system + list(range(500, 532)), 16)
    second = block_hashes(system + list(range(900, 932)), 16)
    index.apply("a", [stored(i, h) for i, h in enumerate(first)])
    assert index.num_matched_blocks("a", second) == 4
    assert index.matched_blocks(second) == {"a": 4}


def test_remove_reset_and_duplicate_delivery() -> None:
    index = PrefixIndex()
    batch = [stored(0, 1), stored(1, 2), stored(2, 3)]
    index.apply("a", batch)
    index.apply("a", batch)  # re-delivered after a poll retry: no effect
    assert index.last_seq("a") == 2 and index.num_blocks("a") == 3
    index.apply("a", [removed(3, 2), removed(2, 1)])  # seq 2 already applied: skipped
    assert index.num_matched_blocks("a", [1, 2, 3]) == 1
    index.apply("a", [removed(4, 99)])  # removing an unknown block is harmless
    index.apply_batch("a", KvEventBatch.from_mapping(
        {"events": [stored(0, 7)], "next": 1, "reset": True}))  # worker restarted
    assert index.num_matched_blocks("a", [1]) == 0 and index.num_matched_blocks("a", [7]) == 1
    assert index.last_seq("a") == 0
    index.forget("a")
    assert index.matched_blocks([7]) == {} and index.last_seq("a") is None
    index.apply("d", [stored(0, 7)])  # reuses the forgotten endpoint's bit
    assert index.matched_blocks([7]) == {"d": 1}


@pytest.mark.parametrize("bad", [
    {"seq": "1", "type": "stored", "block_hash": 1},
    {"seq": 1, "type": "evicted", "block_hash": 1},
    {"seq": 1, "type": "stored", "block_hash": None},
    {"seq": 1, "type": "stored", "block_hash": 1, "parent_hash": "x"},
    {"seq": True, "type": "stored", "block_hash": 1},
])
def test_malformed_events_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        PrefixIndex().apply("a", [bad])
    with pytest.raises(ValueError):
        KvEventBatch.from_mapping({"events": [bad], "next": 2})


def test_event_parsing() -> None:
    assert KvEvent.from_mapping(stored(3, 5, 4)) == KvEvent(3, KvEventType.STORED, 5, 4)
    with pytest.raises(ValueError):
        KvEventBatch.from_mapping({"events": {}, "next": 0})


operations = st.lists(st.tuples(st.sampled_from(ENDPOINTS + ("reset",)), st.sampled_from(ENDPOINTS),
                                st.sampled_from(["stored", "removed"]), st.integers(0, 12)),
                      max_size=200)


@settings(max_examples=120, deadline=None)
@given(ops=operations, queries=st.lists(st.lists(st.integers(0, 12), max_size=8), min_size=1, max_size=6),
       cap=st.integers(1, 8))
def test_matches_reference_model(ops, queries, cap) -> None:
    index, model, seqs = PrefixIndex(max_blocks_per_endpoint=cap), {e: [] for e in ENDPOINTS}, {}
    for kind, endpoint, event_type, h in ops:
        if kind == "reset":
            index.reset(endpoint)
            model[endpoint].clear()
            seqs[endpoint] = 0
            continue
        seq = seqs.get(kind, 0)
        seqs[kind] = seq + 1
        index.apply(kind, [{"seq": seq, "type": event_type, "block_hash": h, "parent_hash": None}])
        lru = model[kind]
        if h in lru:
            lru.remove(h)
        if event_type == "stored":
            lru.append(h)
            del lru[:-cap]  # keep only the `cap` most recently stored
    for endpoint in ENDPOINTS:
        assert index.num_blocks(endpoint) == len(model[endpoint]) <= cap
    for query in queries:
        expected = {}
        for endpoint in ENDPOINTS:
            run = 0
            while run < len(query) and query[run] in model[endpoint]:
                run += 1
            assert index.num_matched_blocks(endpoint, query) == run
            if run:
                expected[endpoint] = run
        assert index.matched_blocks(query) == expected
    assert len(index._holders) == len(set().union(*model.values()))  # no stale holder entries
