"""Approximate mode of the prefix index: blocks recorded from routing decisions, bounded per endpoint
by its capacity estimate; checked against a reference LRU and on real prompt hashes."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from cache.block_hash import block_hashes
from cache.prefix_index import PrefixIndex


def test_only_approximate_endpoints_record_routed_prompts() -> None:
    index = PrefixIndex()
    index.track_routed("approx", max_blocks=100)
    index.store("precise", [1, 2])  # fed by events: routing must not add to it
    index.record_routed("approx", [1, 2, 3])
    index.record_routed("precise", [1, 2, 3])
    index.record_routed("unknown", [1, 2, 3])
    assert index.matched_blocks([1, 2, 3]) == {"approx": 3, "precise": 2}
    assert index.is_approximate("approx") and not index.is_approximate("precise")
    assert index.num_blocks("unknown") == 0


def test_lru_bound_keeps_leading_blocks_longest() -> None:
    index = PrefixIndex()
    index.track_routed("a", max_blocks=4)
    system = list(range(1000, 1032))  # two 16-token blocks every prompt shares
    first = block_hashes(system + list(range(64)), 16)        # 6 blocks
    index.record_routed("a", first)
    assert index.num_blocks("a") == 4
    # recorded last block first: the 2 oldest entries evicted were the prompt's tail, not its head
    assert index.num_matched_blocks("a", first) == 4
    second = block_hashes(system + list(range(500, 532)), 16)  # 4 blocks, 2 shared
    index.record_routed("a", second)
    assert index.num_matched_blocks("a", second) == 4
    assert index.num_matched_blocks("a", first) == 2  # the shared head survived, its tail was evicted


def test_capacity_shrinks_and_grows() -> None:
    index = PrefixIndex()
    index.track_routed("a", max_blocks=8)
    index.record_routed("a", list(range(1, 9)))
    index.set_capacity("a", 3)  # a load report says the endpoint is smaller
    assert index.num_blocks("a") == 3 and index.capacity("a") == 3
    assert index.num_matched_blocks("a", [1, 2, 3, 4]) == 3  # the leading three were the most recent
    index.set_capacity("a", 0)  # never below one block
    assert index.capacity("a") == 1 and index.num_blocks("a") == 1
    index.set_capacity("a", 10)
    index.record_routed("a", list(range(20, 30)))
    assert index.num_blocks("a") == 10
    index.reset("a")  # keeps its mode and capacity
    assert index.num_blocks("a") == 0 and index.is_approximate("a") and index.capacity("a") == 10
    assert index.matched_blocks(list(range(20, 30))) == {}


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.tuples(st.sampled_from("ab"), st.lists(st.integers(0, 15), max_size=6)), max_size=60),
       cap=st.integers(1, 10))
def test_matches_a_reference_lru(prompts, cap) -> None:
    index = PrefixIndex()
    model: dict[str, list[int]] = {"a": [], "b": []}  # oldest first
    for endpoint in model:
        index.track_routed(endpoint, cap)
    for endpoint, hashes in prompts:
        index.record_routed(endpoint, hashes)
        lru = model[endpoint]
        for h in reversed(hashes):
            if h in lru:
                lru.remove(h)
            lru.append(h)
            del lru[:-cap]
        assert index.num_blocks(endpoint) == len(lru) <= cap
        for e, blocks in model.items():
            run = 0
            while run < len(hashes) and hashes[run] in blocks:
                run += 1
            assert index.num_matched_blocks(e, hashes) == run
    assert len(index._holders) == len(set(model["a"]) | set(model["b"]))
