"""prefix_aware: cached prompt blocks (a KV tier's at a discount) against load, within a load bound;
least_tokens otherwise."""
from __future__ import annotations

import pytest

from policies.base import DecisionReason
from policies.registry import PolicyName, make_policy
from tests.policies.helpers import ep, facts


def select(endpoints, block_size=16, **options):
    return make_policy(PolicyName.PREFIX_AWARE, {"seed": 0, **options}).select(
        facts(hashes=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), block_size=block_size), endpoints)


@pytest.mark.parametrize(("options", "endpoints", "expected", "reason"), [
    # the endpoint holding the prefix wins at equal load
    ({}, [ep("a"), ep("b", matched=3), ep("c", matched=1)], "b", DecisionReason.PREFIX_HIT),
    # 10 blocks x 16 = 160 cached tokens outweigh 100 tokens in flight (default alpha 0.5)...
    ({}, [ep("a", matched=10, decode=100), ep("b", decode=0), ep("c", decode=100)], "a", DecisionReason.PREFIX_HIT),
    # ...but not at alpha 2 (score 160 - 200 < 0)
    ({"alpha": 2.0}, [ep("a", matched=10, decode=100), ep("b"), ep("c", decode=100)], "b", DecisionReason.BALANCED),
    # the request's block size scales what a block is worth: 10 x 4 = 40 < 0.5 x 100
    ({"block_size": 4}, [ep("a", matched=10, decode=100), ep("b"), ep("c", decode=100)], "b", DecisionReason.BALANCED),
    # over the load bound, a cache hit does not count (score 160 - 150 > 0 would have won):
    # mean (3001+6+1)/3 = 1002.7, bound 1504
    ({"alpha": 0.05}, [ep("a", matched=10, decode=3000), ep("b", decode=5), ep("c", decode=0)], "c",
     DecisionReason.BALANCED),
    ({"load_factor": 3.5, "alpha": 0.05}, [ep("a", matched=10, decode=3000), ep("b", decode=5), ep("c")], "a",
     DecisionReason.PREFIX_HIT),
    # nothing cached anywhere: least tokens (not least requests)
    ({}, [ep("a", requests=1, prefill=700), ep("b", requests=3, decode=90), ep("c", decode=95)], "b",
     DecisionReason.BALANCED),
    # a cached but unhealthy endpoint is ignored
    ({}, [ep("a", matched=10, healthy=False), ep("b", decode=9), ep("c", decode=3)], "c", DecisionReason.BALANCED),
])
def test_choice_table(options, endpoints, expected, reason) -> None:
    d = select(endpoints, **options)
    assert (d.endpoint_id, d.reason, d.session_moved_from) == (expected, reason, None)


@pytest.mark.parametrize(("options", "endpoints", "expected"), [
    # the same run of 6 blocks: device > cpu > disk > store (weights 1, 0.8, 0.5, 0.3)
    ({}, [ep("store", tiers=(0, 0, 6)), ep("disk", tiers=(0, 6, 0)), ep("cpu", tiers=(6, 0, 0)), ep("dev", matched=6)],
     "dev"),
    ({}, [ep("store", tiers=(0, 0, 6)), ep("disk", tiers=(0, 6, 0)), ep("cpu", tiers=(6, 0, 0))], "cpu"),
    ({}, [ep("store", tiers=(0, 0, 6)), ep("disk", tiers=(0, 6, 0)), ep("none")], "disk"),
    ({}, [ep("store", tiers=(0, 0, 6)), ep("none")], "store"),
    # device run + the tier blocks past it add up: 2 + 0.8 x 4 = 5.2 blocks beat 5 on the device...
    ({}, [ep("dev", matched=5), ep("both", matched=2, tiers=(4, 0, 0))], "both"),
    # ...and a long tier run beats a short device run: 0.8 x 8 = 6.4 > 4...
    ({}, [ep("dev", matched=4), ep("cpu", tiers=(8, 0, 0))], "cpu"),
    # ...unless its weight says reading it back costs more: 0.4 x 8 = 3.2 < 4
    ({"cpu_weight": 0.4}, [ep("dev", matched=4), ep("cpu", tiers=(8, 0, 0))], "dev"),
    # a disk hit outweighs less load than a device hit: 0.5 x 10 x 16 = 80 < 0.5 x 200 in flight < 160
    ({"load_factor": 10.0}, [ep("disk", tiers=(0, 10, 0), decode=200), ep("idle")], "idle"),
    ({"load_factor": 10.0}, [ep("dev", matched=10, decode=200), ep("idle")], "dev"),
    # a measured restore fraction replaces the fixed weight: disk read back at 0.04 of its compute is worth
    # 0.96 x 10 x 16 = 153.6 > 100 in flight...
    ({"load_factor": 10.0}, [ep("disk", tiers=(0, 10, 0), decode=200, restore=(None, 0.04, None)), ep("idle")],
     "disk"),
    # ...unless measured weights are off, or the figure is for another medium (then 0.5 x 160 = 80 < 100)
    ({"load_factor": 10.0, "measured_tier_weights": False},
     [ep("disk", tiers=(0, 10, 0), decode=200, restore=(None, 0.04, None)), ep("idle")], "idle"),
    ({"load_factor": 10.0}, [ep("disk", tiers=(0, 10, 0), decode=200, restore=(0.01, None, None)), ep("idle")],
     "idle"),
    # a slow medium measured at more than its compute is worth nothing (0 x 8 < 4 on the device), and a
    # fraction below 0 counts as free, never above a device block (1 x 5 < 6, where 1.5 x 5 would win)
    ({}, [ep("dev", matched=4), ep("store", tiers=(0, 0, 8), restore=(None, None, 1.7))], "dev"),
    ({}, [ep("dev", matched=6), ep("cpu", tiers=(5, 0, 0), restore=(-0.5, None, None))], "dev"),
    ({}, [ep("dev", matched=4), ep("cpu", tiers=(5, 0, 0), restore=(-0.5, None, None))], "cpu"),
])
def test_tier_hits_are_discounted(options, endpoints, expected) -> None:
    d = select(endpoints, **options)
    assert d.endpoint_id == expected
    hit = any(e.num_matched_blocks or any(e.num_tier_matched_blocks) for e in endpoints if e.endpoint_id == expected)
    assert d.reason is (DecisionReason.PREFIX_HIT if hit else DecisionReason.BALANCED)


def test_tier_weights_are_checked_and_a_tier_hit_counts_for_the_prefix_key() -> None:
    for bad in ({"cpu_weight": 1.5}, {"disk_weight": -0.1}, {"store_weight": "0.3"}, {"measured_tier_weights": "yes"}):
        with pytest.raises(ValueError):
            make_policy(PolicyName.PREFIX_AWARE, bad)
    policy = make_policy(PolicyName.PREFIX_AWARE, {"seed": 0, "cpu_weight": 1.0})
    picks = {policy.select(facts(hashes=(1, 2, 3)), [ep("a", matched=3), ep("b", tiers=(3, 0, 0))]).endpoint_id
             for _ in range(50)}
    assert picks == {"a", "b"}  # weight 1: as good as the device
    keyed = make_policy(PolicyName.PREFIX_AWARE, {"seed": 0, "prefix_key_tokens": 32})  # 2 blocks of 16
    d = keyed.select(facts(hashes=(1, 2, 3)), [ep("a", matched=1, tiers=(0, 1, 0)), ep("b"), ep("c")])
    assert (d.endpoint_id, d.reason) == ("a", DecisionReason.PREFIX_HIT)  # holds both key blocks, one on disk


def test_equal_hits_share_the_load() -> None:
    policy = make_policy(PolicyName.PREFIX_AWARE, {"seed": 1})
    endpoints = [ep("a", matched=4), ep("b", matched=4), ep("c")]
    picks = {policy.select(facts(hashes=(1, 2, 3, 4)), endpoints).endpoint_id for _ in range(50)}
    assert picks == {"a", "b"}


def test_prefix_key_routes_prompts_no_index_knows_by_their_ring_home() -> None:
    """With prefix_key_tokens, a prompt whose key blocks no candidate holds goes to its key's ring home
    (the same in every gateway process, whatever its own index saw); a deeper match is scored as usual."""
    from policies.session_affinity import HashRing, ring_hash
    policy = make_policy(PolicyName.PREFIX_AWARE, {"seed": 0, "prefix_key_tokens": 32})  # 2 blocks of 16
    ids = [f"http://w{i}:8000" for i in range(6)]
    ring = HashRing(ids, 100)
    for conversation in range(10):
        hashes = (7, 100 + conversation, 5, 6)  # block 7: a system prompt cached everywhere
        home = ring.first(ring_hash(f"prefix:{100 + conversation:x}"), dict.fromkeys(ids))
        shallow = [ep(i, matched=1) for i in ids]
        d = policy.select(facts(hashes=hashes), shallow)
        assert (d.endpoint_id, d.reason) == (home, DecisionReason.PREFIX_AFFINITY)
        deep = [ep(i, matched=3 if i == ids[conversation % 6] else 1) for i in ids]
        d = policy.select(facts(hashes=hashes), deep)
        assert (d.endpoint_id, d.reason) == (ids[conversation % 6], DecisionReason.PREFIX_HIT)
    off = make_policy(PolicyName.PREFIX_AWARE, {"seed": 0})
    assert off.select(facts(hashes=(7, 8)), [ep(i, matched=1) for i in ids]).reason is DecisionReason.PREFIX_HIT
    with pytest.raises(ValueError):
        make_policy(PolicyName.PREFIX_AWARE, {"prefix_key_tokens": -1})
