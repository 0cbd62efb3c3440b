"""Shared KV stores in the prefix index: an endpoint whose worker names a store (its load report's key) is credited
with every block any reader of that store announced there (`PrefixIndex.share_store`), checked by hand and against a
plain reference model of per-store LRUs."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from cache.kv_events import CPU, DEVICE, DISK, MEDIA, STORE
from cache.prefix_index import PrefixIndex
from tests.cache.test_prefix_index import ENDPOINTS, reference_by_medium


def test_a_shared_stores_blocks_count_at_every_endpoint_that_reads_it() -> None:
    """Workers that name one store (the key their load reports give) are each credited with what any of them wrote
    there; a worker of another store, or one that names none, is not."""
    index = PrefixIndex()
    index.store("a", [1, 2, 3], STORE)        # announced before a's store was known: credited to a alone
    assert index.matched_blocks_by_medium([1, 2, 3]) == {"a": (0, 0, 0, 3)}
    for endpoint, key in (("a", "s"), ("b", "s"), ("c", "t")):
        index.share_store(endpoint, key)
    index.store("d", [1, 2, 3], CPU)
    index.store("b", [1])                     # b's device has the first block; the store the rest
    index.store("c", [1, 2], CPU)
    bits = {e: index.endpoint_bit(e) for e in "abcd"}
    assert index.matched_blocks_by_medium([1, 2, 3, 4]) == {
        "a": (0, 0, 0, 3), "b": (1, 0, 0, 2), "c": (0, 2, 0, 0), "d": (0, 3, 0, 0)}
    assert index.tiered_mask == bits["a"] | bits["b"] | bits["c"] | bits["d"]
    index.store("b", [4], STORE)              # written by b, read by a as well
    index.store("a", [2], CPU)                # and a block a also holds in RAM is read from RAM
    assert index.matched_blocks_by_medium([1, 2, 3, 4])["a"] == (0, 1, 0, 3)
    index.reset("a")                          # a's events were lost: the store's blocks stay with the store
    assert index.matched_blocks_by_medium([1, 2, 3, 4])["a"] == (0, 0, 0, 4)
    index.share_store("a", None)              # a no longer reads it
    index.forget("b")
    assert index.matched_blocks_by_medium([1, 2, 3, 4]) == {"c": (0, 2, 0, 0), "d": (0, 3, 0, 0)}
    assert not index.tiered_mask & bits["a"]
    index.share_store("e", "s")               # a new reader of the store: credited at once
    assert index.matched_blocks_by_medium([1, 2])["e"] == (0, 0, 0, 2)
    assert index.tiered_mask & index.endpoint_bit("e")


def reference_held_levels(index: PrefixIndex, model: StoreModel, query: list[int]) -> list[tuple[int, int]]:
    """`own_tier_levels` by its definition: of the endpoints holding tier blocks of their own, each one's leading
    run of `query` in what it can read (device, own tiers, the store it reads), as nested masks by depth."""
    runs = {}
    for endpoint in ENDPOINTS:
        if not model.tiers[endpoint]:
            continue
        held = set(model.device[endpoint]) | set(model.readable(endpoint))
        runs[endpoint] = next((i for i, h in enumerate(query) if h not in held), len(query))
    depths = sorted({run for run in runs.values() if run})
    return [(depth, sum(index.endpoint_bit(e) for e, run in runs.items() if run >= depth)) for depth in depths]


store_operations = st.lists(st.one_of(
    st.tuples(st.just("event"), st.sampled_from(ENDPOINTS), st.sampled_from(["stored", "removed"]),
              st.integers(0, 5), st.sampled_from(MEDIA)),
    st.tuples(st.just("share"), st.sampled_from(ENDPOINTS), st.sampled_from(["s", "t", None])),
    st.tuples(st.just("reset"), st.sampled_from(ENDPOINTS))), min_size=10, max_size=150)


class StoreModel:
    """The reference for shared stores: each store one LRU of `cap` blocks that its readers' STORE events feed; an
    endpoint's run reads its own tiers and the store it names (its own STORE blocks move there when it names one)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.device: dict[str, list[int]] = {e: [] for e in ENDPOINTS}
        self.tiers: dict[str, dict[int, set[str]]] = {e: {} for e in ENDPOINTS}
        self.stores: dict[str, list[int]] = {"s": [], "t": []}
        self.reads: dict[str, str | None] = dict.fromkeys(ENDPOINTS)

    def put(self, lru: list[int], h: int) -> None:
        if h in lru:
            lru.remove(h)
        lru.append(h)
        del lru[:-self.cap]

    def drop(self, endpoint: str, h: int, medium: str) -> None:
        if medium in self.tiers[endpoint].get(h, ()):
            self.tiers[endpoint][h].discard(medium)
            if not self.tiers[endpoint][h]:
                del self.tiers[endpoint][h]

    def share(self, endpoint: str, key: str | None) -> None:
        if key is not None and key != self.reads[endpoint]:
            for h in [h for h, media in self.tiers[endpoint].items() if STORE in media]:
                self.drop(endpoint, h, STORE)
                self.put(self.stores[key], h)
        self.reads[endpoint] = key

    def event(self, endpoint: str, event_type: str, h: int, medium: str) -> None:
        key, tiers = self.reads[endpoint], self.tiers[endpoint]
        if medium == DEVICE:
            if h in self.device[endpoint]:
                self.device[endpoint].remove(h)
            if event_type == "stored":
                self.put(self.device[endpoint], h)
        elif medium == STORE and key is not None:
            if event_type == "stored":
                self.put(self.stores[key], h)
            elif h in self.stores[key]:
                self.stores[key].remove(h)
        elif event_type == "stored":
            tiers[h] = tiers.pop(h, set()) | {medium}
            while len(tiers) > self.cap:
                del tiers[next(iter(tiers))]
        else:
            self.drop(endpoint, h, medium)

    def readable(self, endpoint: str) -> dict[int, set[str]]:
        media = {h: set(m) for h, m in self.tiers[endpoint].items()}
        key = self.reads[endpoint]
        for h in self.stores[key] if key is not None else ():
            media[h] = media.get(h, set()) | {STORE}
        return media


@settings(max_examples=150, deadline=None)
@given(ops=store_operations, queries=st.lists(st.lists(st.integers(0, 5), max_size=8), min_size=1, max_size=6),
       cap=st.integers(1, 8))
def test_shared_stores_match_the_reference_model(ops, queries, cap) -> None:
    index, seqs, model = PrefixIndex(max_blocks_per_endpoint=cap), dict.fromkeys(ENDPOINTS, 0), StoreModel(cap)
    for op in ops:
        if op[0] == "reset":
            index.reset(op[1])
            model.device[op[1]].clear()
            model.tiers[op[1]].clear()
            seqs[op[1]] = 0
        elif op[0] == "share":
            index.share_store(op[1], op[2])
            model.share(op[1], op[2])
        else:
            _, endpoint, event_type, h, medium = op
            index.apply(endpoint, [{"seq_no": seqs[endpoint], "kind": event_type, "block_hash": h,
                                    "parent_hash": None, "num_tokens": 16, "medium": medium}])
            seqs[endpoint] += 1
            model.event(endpoint, event_type, h, medium)
    for endpoint in ENDPOINTS:
        assert bool(index.tiered_mask & index.endpoint_bit(endpoint)) == bool(model.readable(endpoint))
    for query in queries:
        expected = {}
        for endpoint in ENDPOINTS:
            by_medium = reference_by_medium(model.device[endpoint], model.readable(endpoint), query)
            if any(by_medium):
                expected[endpoint] = by_medium
        assert index.matched_blocks_by_medium(query) == expected
        for endpoint in ENDPOINTS:   # one endpoint's row, its device run known (a live view's pick)
            run = index.num_matched_blocks(endpoint, query)
            assert index.matched_by_medium(endpoint, query, run) == expected.get(endpoint, (0, 0, 0, 0))
        assert index.own_tier_levels(query) == reference_held_levels(index, model, query)


def test_own_tier_levels_follow_removals_evictions_and_resets() -> None:
    index = PrefixIndex(max_blocks_per_endpoint=3)
    index.store("a", [1, 2, 3], CPU)
    index.store("b", [1], DEVICE)
    index.store("b", [2], DISK)
    a, b = index.endpoint_bit("a"), index.endpoint_bit("b")
    assert index.own_tier_levels([1, 2, 3]) == [(2, a | b), (3, a)]
    index.remove("a", [2], CPU)                       # gone from its only tier
    assert index.own_tier_levels([1, 2, 3]) == [(1, a | b), (2, b)]
    index.store("a", [2, 7, 8], CPU)                  # 1 and 3 are the oldest of a tier of 3 blocks: evicted
    assert index.own_tier_levels([1, 2, 3]) == [(2, b)]
    index.reset("b")
    assert index.own_tier_levels([1, 2, 3]) == [] and index.own_tier_mask == a
