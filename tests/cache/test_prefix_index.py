"""PrefixIndex against a plain reference model (a bounded LRU list per endpoint, the leading run
counted naively), plus event parsing, reset, duplicate delivery and memory bounds. Events are written
as a worker's `GET /kv_events` sends them (`test_the_worker_route_feeds_the_index` pins that format)."""
from __future__ import annotations

import dataclasses

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from cache.block_hash import ROOT_HASH, block_hashes
from cache.prefix_index import KvEvent, KvEventBatch, KvEventType, PrefixIndex

ENDPOINTS = ("a", "b", "c")


def stored(seq_no: int, h: int, parent: int = ROOT_HASH) -> dict:
    return {"seq_no": seq_no, "kind": "stored", "block_hash": h, "parent_hash": parent, "num_tokens": 16}


def removed(seq_no: int, h: int) -> dict:
    return {"seq_no": seq_no, "kind": "removed", "block_hash": h, "parent_hash": None, "num_tokens": 16}


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
    parents = [ROOT_HASH, *first[:-1]]
    index.apply("a", [stored(i + 1, h, p) for i, (h, p) in enumerate(zip(first, parents, strict=True))])
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
    {**stored(1, 1), "seq_no": "1"},
    {**stored(1, 1), "kind": "evicted"},
    {**stored(1, 1), "block_hash": None},
    {**stored(1, 1), "parent_hash": "x"},
    {**stored(1, 1), "seq_no": True},
    {**stored(1, 1), "num_tokens": None},
    {"seq": 1, "type": "stored", "block_hash": 1, "parent_hash": None},  # the names this parser once read
])
def test_malformed_events_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        PrefixIndex().apply("a", [bad])
    with pytest.raises(ValueError):
        KvEventBatch.from_mapping({"events": [bad], "next": 2})


def test_event_parsing() -> None:
    assert KvEvent.from_mapping(stored(3, 5, 4)) == KvEvent(3, KvEventType.STORED, 5, 4, 16)
    assert KvEvent.from_mapping(stored(1, 5)).parent_hash == ROOT_HASH
    assert KvEvent.from_mapping(removed(4, 5)) == KvEvent(4, KvEventType.REMOVED, 5, None, 16)
    for event in (stored(3, 5, 4), removed(4, 5)):
        assert KvEvent.from_mapping(event).to_mapping() == event
    batch = {"events": [stored(1, 5), removed(2, 5)], "next": 2, "reset": True}
    assert KvEventBatch.from_mapping(batch).to_mapping() == batch
    with pytest.raises(ValueError):
        KvEventBatch.from_mapping({"events": {}, "next": 0})


async def test_the_worker_route_feeds_the_index() -> None:
    """The contract with our workers: a real BlockManager's events, served by the worker's own
    `/kv_events` handler, parse here with the worker's field names and semantics (a first block's
    parent is ROOT_HASH; an evicted block leaves the index)."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from backends.engine.block_manager import BlockManager
    from backends.engine.kv_events import KVEvent, KVEventBatch, KVEventRing
    from backends.engine.sampling_params import SamplingParams
    from backends.engine.sequence import Sequence
    from backends.server import ops_routes
    from backends.server.keys import ENGINE_KEY

    assert [f.name for f in dataclasses.fields(KvEvent)] == [f.name for f in dataclasses.fields(KVEvent)]
    ring = KVEventRing(64)
    manager = BlockManager(4, 16, events=ring)
    first, second = list(range(100, 149)), list(range(500, 549))  # 3 full blocks and one token each
    for request_id, tokens in (("first", first), ("second", second)):  # the second evicts the first's blocks
        sequence = Sequence(request_id, tuple(tokens), SamplingParams(), seed=0)
        manager.allocate(sequence)
        sequence.num_computed_tokens = sequence.num_tokens
        manager.cache_computed_blocks(sequence)
        manager.free(sequence)

    class Engine:  # the one method of the worker's engine surface the route calls, on the real ring
        def kv_events(self, since: int, limit: int = 1000) -> KVEventBatch:
            return ring.since(since, limit)

    app = web.Application()
    app[ENGINE_KEY] = Engine()  # type: ignore[misc]
    response = await ops_routes.kv_events(make_mocked_request("GET", "/kv_events?since=0", app=app))
    batch = KvEventBatch.from_mapping(orjson.loads(response.body))
    assert [(e.kind, e.parent_hash) for e in batch.events[:3]] == [
        (KvEventType.STORED, ROOT_HASH), *[(KvEventType.STORED, h) for h in block_hashes(first, 16)[:2]]]
    assert {e.kind for e in batch.events} == {KvEventType.STORED, KvEventType.REMOVED}
    assert batch.next_seq == batch.events[-1].seq_no == ring.last_seq_no and not batch.reset
    index = PrefixIndex()
    index.apply_batch("w", batch)
    assert index.num_matched_blocks("w", block_hashes(second, 16)) == 3
    assert index.num_matched_blocks("w", block_hashes(first, 16)) == 0
    assert index.last_seq("w") == ring.last_seq_no


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
        index.apply(kind, [{"seq_no": seq, "kind": event_type, "block_hash": h, "parent_hash": None,
                            "num_tokens": 16}])
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
