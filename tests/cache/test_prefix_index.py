"""PrefixIndex against a plain reference model (per endpoint, a bounded LRU list of device blocks and
one of tier blocks with their media; the leading runs counted naively), plus event parsing, media,
reset, duplicate delivery and memory bounds. Events are written as a worker's `GET /kv_events` sends
them (`test_the_worker_route_feeds_the_index` pins that format)."""
from __future__ import annotations

import dataclasses

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from cache.block_hash import ROOT_HASH, block_hashes
from cache.kv_events import CPU, DEVICE, DISK, MEDIA, MEDIUM_BITS, STORE, KvEvent, KvEventBatch, KvEventType
from cache.prefix_index import PrefixIndex
from policies.fleet_view import run_of

ENDPOINTS = ("a", "b", "c")


def stored(seq_no: int, h: int, parent: int = ROOT_HASH, medium: str = DEVICE) -> dict:
    return {"seq_no": seq_no, "kind": "stored", "block_hash": h, "parent_hash": parent, "num_tokens": 16,
            "medium": medium}


def removed(seq_no: int, h: int, medium: str = DEVICE) -> dict:
    return {"seq_no": seq_no, "kind": "removed", "block_hash": h, "parent_hash": None, "num_tokens": 16,
            "medium": medium}


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


def test_a_block_lies_in_several_media_and_each_removal_is_its_own() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(1, 1), stored(2, 1, medium=CPU), stored(3, 2, medium=CPU), stored(4, 2, medium=DISK)])
    assert index.matched_blocks_by_medium([1, 2]) == {"a": (1, 1, 0, 0)}
    index.apply("a", [removed(5, 1)])  # evicted from the device; host RAM still holds it
    assert index.matched_blocks_by_medium([1, 2]) == {"a": (0, 2, 0, 0)}
    assert index.matched_blocks([1, 2]) == {} and index.num_matched_blocks("a", [1, 2]) == 0
    index.apply("a", [removed(6, 2, CPU)])  # the disk copy of block 2 is left
    assert index.matched_blocks_by_medium([1, 2]) == {"a": (0, 1, 1, 0)}
    index.apply("a", [removed(7, 2, STORE), removed(8, 1, DISK)])  # media that do not hold them: no effect
    assert index.matched_blocks_by_medium([1, 2]) == {"a": (0, 1, 1, 0)}
    index.apply("a", [stored(9, 1), stored(10, 2)])  # loaded back onto the device, still in their tiers
    assert index.matched_blocks_by_medium([1, 2]) == {"a": (2, 0, 0, 0)}
    index.apply("a", [removed(11, 1), removed(12, 2)])
    assert index.matched_blocks_by_medium([1, 2]) == {"a": (0, 1, 1, 0)}
    index.reset("a")  # forgets the tiers too
    assert index.matched_blocks_by_medium([1, 2]) == {} and not index._holders and not index._endpoints["a"].tiers


@pytest.mark.parametrize(("events", "expected"), [
    # as the worker's connector reads them: the device run, then blocks in host RAM or on disk (each
    # from the faster holding it), then the store's
    ([(1, DEVICE), (2, DEVICE), (3, CPU), (4, DISK), (5, STORE)], (2, 1, 1, 1)),
    ([(1, DISK), (1, STORE), (2, CPU), (2, DISK), (3, STORE)], (0, 1, 1, 1)),
    ([(1, DISK), (2, CPU), (3, DEVICE), (4, CPU)], (0, 1, 1, 0)),         # past the device run, only tiers count
    ([(1, CPU), (2, STORE), (3, CPU)], (0, 1, 0, 1)),                     # after the store, no local tier again
    ([(1, STORE), (2, STORE), (2, CPU)], (0, 1, 0, 1)),                   # in the store's run, read from RAM if there
    ([(1, DEVICE), (3, CPU)], (1, 0, 0, 0)),                              # the run ends at the gap
    ([(2, DEVICE), (3, CPU)], None),                                      # no leading block: no match
])
def test_matched_blocks_by_medium(events: list[tuple[int, str]], expected: tuple[int, ...] | None) -> None:
    index = PrefixIndex()
    index.apply("a", [stored(i, h, medium=m) for i, (h, m) in enumerate(events)])
    index.apply("b", [stored(0, 1), stored(1, 2)])  # another endpoint's runs do not bleed into a's
    matched = index.matched_blocks_by_medium([1, 2, 3, 4, 5])
    assert matched.get("a") == expected and matched["b"] == (2, 0, 0, 0)
    assert index.matched_blocks([1, 2, 3, 4, 5]).get("a", 0) == (expected or (0,))[0]


def test_tier_blocks_have_their_own_bound() -> None:
    """Store blocks are never REMOVED by events: their LRU's bound ages them out, without pushing the
    device blocks (bounded by the endpoint's capacity) out of the index."""
    index = PrefixIndex(max_blocks_per_endpoint=3)
    index.store("a", [1, 2])
    index.store("a", [10, 11, 12, 13], STORE)
    assert index.num_blocks("a") == 2 and list(index._endpoints["a"].tiers) == [11, 12, 13]
    assert index.matched_blocks_by_medium([1, 2, 11]) == {"a": (2, 0, 0, 1)}
    index.remove("a", [11], STORE)
    index.remove("zz", [1], CPU)  # an unknown endpoint: ignored
    assert index.matched_blocks_by_medium([1, 2, 11]) == {"a": (2, 0, 0, 0)}


@pytest.mark.parametrize("bad", [
    {**stored(1, 1), "seq_no": "1"},
    {**stored(1, 1), "kind": "evicted"},
    {**stored(1, 1), "block_hash": None},
    {**stored(1, 1), "parent_hash": "x"},
    {**stored(1, 1), "seq_no": True},
    {**stored(1, 1), "num_tokens": None},
    {"seq": 1, "type": "stored", "block_hash": 1, "parent_hash": None},  # the names this parser once read
    stored(1, 1, medium="gpu"),                                          # vLLM's name, not ours
    stored(1, 1, medium="ssd"),
    {**stored(1, 1), "medium": None},                                    # absent means device; null is malformed
    {**stored(1, 1), "medium": ["cpu"]},
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
    assert KvEvent.from_mapping(stored(3, 5, 4, DISK)) == KvEvent(3, KvEventType.STORED, 5, 4, 16, DISK)
    for event in (stored(3, 5, 4), removed(4, 5), stored(5, 6, 5, STORE), removed(6, 6, CPU)):
        assert KvEvent.from_mapping(event).to_mapping() == event
    old = {k: v for k, v in stored(3, 5, 4).items() if k != "medium"}  # a worker from before KV tiers
    assert KvEvent.from_mapping(old).medium == DEVICE
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

    from backends.core.block_events import MEDIA as WORKER_MEDIA, KVEvent, KVEventBatch, KVEventRing
    from backends.core.block_manager import BlockManager
    from backends.core.sampling_params import SamplingParams
    from backends.core.sequence import Sequence
    from backends.server import ops_routes
    from backends.server.app_keys import ENGINE_KEY

    assert [f.name for f in dataclasses.fields(KvEvent)] == [f.name for f in dataclasses.fields(KVEvent)]
    assert MEDIA == WORKER_MEDIA
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


operations = st.lists(st.tuples(st.sampled_from((*ENDPOINTS, "reset")), st.sampled_from(ENDPOINTS),
                                st.sampled_from(["stored", "removed"]), st.integers(0, 12),
                                st.sampled_from(MEDIA)),
                      min_size=10, max_size=200)  # long enough that blocks meet in several media


def reference_by_medium(device: list[int], tiers: dict[int, set[str]], query: list[int]) -> tuple[int, ...]:
    """The leading run as the worker's connector reads it: device blocks, then blocks in host RAM or on
    disk, then the store's; each counted under the fastest tier holding it."""
    counts = [0] * len(MEDIA)
    n = 0
    while n < len(query) and query[n] in device:
        counts[0] += 1
        n += 1
    for reachable in ({CPU, DISK}, {STORE}):
        while n < len(query) and tiers.get(query[n], set()) & reachable:
            counts[min(MEDIA.index(m) for m in tiers[query[n]])] += 1
            n += 1
    return tuple(counts)


@settings(max_examples=150, deadline=None)
@given(ops=operations, queries=st.lists(st.lists(st.integers(0, 12), max_size=8), min_size=1, max_size=6),
       cap=st.integers(1, 8))
def test_matches_reference_model(ops, queries, cap) -> None:
    index, seqs = PrefixIndex(max_blocks_per_endpoint=cap), {}
    model: dict[str, list[int]] = {e: [] for e in ENDPOINTS}              # device blocks, oldest first
    tier_model: dict[str, dict[int, set[str]]] = {e: {} for e in ENDPOINTS}  # tier blocks -> media, oldest first
    for kind, endpoint, event_type, h, medium in ops:
        if kind == "reset":
            index.reset(endpoint)
            model[endpoint].clear()
            tier_model[endpoint].clear()
            seqs[endpoint] = 0
            continue
        seq = seqs.get(kind, 0)
        seqs[kind] = seq + 1
        event = {"seq_no": seq, "kind": event_type, "block_hash": h, "parent_hash": None, "num_tokens": 16}
        index.apply(kind, [event if medium == DEVICE and seq % 2 else {**event, "medium": medium}])
        if medium == DEVICE:
            lru = model[kind]
            if h in lru:
                lru.remove(h)
            if event_type == "stored":
                lru.append(h)
                del lru[:-cap]  # keep only the `cap` most recently stored
        elif event_type == "stored":
            tiers = tier_model[kind]
            tiers[h] = tiers.pop(h, set()) | {medium}
            while len(tiers) > cap:
                del tiers[next(iter(tiers))]
        elif medium in tier_model[kind].get(h, ()):
            tier_model[kind][h].discard(medium)
            if not tier_model[kind][h]:
                del tier_model[kind][h]
    for endpoint in ENDPOINTS:
        assert index.num_blocks(endpoint) == len(model[endpoint]) <= cap
    for query in queries:
        expected, expected_by_medium = {}, {}
        for endpoint in ENDPOINTS:
            run = 0
            while run < len(query) and query[run] in model[endpoint]:
                run += 1
            assert index.num_matched_blocks(endpoint, query) == run
            if run:
                expected[endpoint] = run
            by_medium = reference_by_medium(model[endpoint], tier_model[endpoint], query)
            if any(by_medium):
                expected_by_medium[endpoint] = by_medium
        assert index.matched_blocks(query) == expected
        assert index.matched_blocks_by_medium(query) == expected_by_medium
        levels = index.lazy_levels(query)   # the live view's path: each run read off the nested holder masks
        assert not levels.walked
        assert list(levels) == index.matched_levels(query) and levels.walked
        for endpoint in ENDPOINTS:
            assert run_of(index.endpoint_bit(endpoint), levels) == expected.get(endpoint, 0)
    assert len(index._holders) == len(set().union(*model.values()))  # no stale holder entries
    for endpoint in ENDPOINTS:
        blocks = index._endpoints.get(endpoint)
        tiers = {h: {m for m in MEDIA if bits & MEDIUM_BITS[m]} for h, bits in blocks.tiers.items()} if blocks else {}
        assert list(tiers.items()) == list(tier_model[endpoint].items())  # same media, same LRU order
