"""Session affinity: consistent hashing with bounded loads. The expected ring home is computed
here from the definition (each endpoint's virtual-node points; the first point clockwise)."""
from __future__ import annotations

import bisect
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from policies.base import DecisionReason, prefix_affinity_key
from policies.registry import PolicyName, make_policy
from policies.session_affinity import ring_hash
from tests.policies.helpers import ep, facts, fleet

VNODES = 100


def ring_order(session_key: str, endpoint_ids: list[str]) -> list[str]:
    """Endpoints in the order a ring walk from the session key's hash meets them."""
    points = sorted((ring_hash(f"{e}#{i}"), e) for e in endpoint_ids for i in range(VNODES))
    start = bisect.bisect_right([p for p, _ in points], ring_hash(session_key))
    order: list[str] = []
    for k in range(len(points)):
        e = points[(start + k) % len(points)][1]
        if e not in order:
            order.append(e)
    return order


def policy(**options: object):
    return make_policy(PolicyName.SESSION_AFFINITY, {"num_virtual_nodes": VNODES, "seed": 0, **options})


def test_new_session_goes_to_its_ring_home_and_sticks() -> None:
    p, endpoints = policy(), fleet(8)
    ids = [e.endpoint_id for e in endpoints]
    for key in ("alice", "bob", "agent-7/turn", "x"):
        home = ring_order(key, ids)[0]
        d = p.select(facts(key), endpoints)
        assert (d.endpoint_id, d.reason, d.session_moved_from) == (home, DecisionReason.AFFINITY_NEW, None)
        for _ in range(5):  # the gateway stored the assignment; the session stays
            d = p.select(facts(key, home), endpoints)
            assert (d.endpoint_id, d.reason, d.session_moved_from) == (home, DecisionReason.AFFINITY_HIT, None)


def test_current_assignment_wins_over_ring_home() -> None:
    """A session re-homed earlier stays where it now is (its cache is there), while within bound."""
    p, endpoints = policy(), fleet(4)
    ids = [e.endpoint_id for e in endpoints]
    elsewhere = ring_order("s", ids)[2]
    d = p.select(facts("s", elsewhere), endpoints)
    assert (d.endpoint_id, d.reason) == (elsewhere, DecisionReason.AFFINITY_HIT)


def test_overloaded_home_spills_to_next_within_bound() -> None:
    ids = [f"http://w{i}:8000" for i in range(4)]
    order = ring_order("sess", ids)
    home, second, third = order[0], order[1], order[2]
    # loads (tokens + 1): home 1001, second 601, others 1 -> mean 401, bound 1.25 * 401 = 501.25
    load = {home: 1000, second: 600}
    endpoints = [ep(i, decode=load.get(i, 0)) for i in ids]
    p = policy()
    d = p.select(facts("sess", home), endpoints)
    assert (d.endpoint_id, d.reason, d.session_moved_from) == (third, DecisionReason.AFFINITY_MOVED, home)
    d = p.select(facts("sess"), endpoints)  # a new session with this key spills the same way
    assert (d.endpoint_id, d.reason, d.session_moved_from) == (third, DecisionReason.AFFINITY_NEW, None)
    # a looser bound keeps the session home: 1001 <= 2.5 * 401
    d = policy(load_factor=2.5).select(facts("sess", home), endpoints)
    assert (d.endpoint_id, d.reason) == (home, DecisionReason.AFFINITY_HIT)


def test_unhealthy_or_missing_home_is_rehomed() -> None:
    p, endpoints = policy(), fleet(5)
    ids = [e.endpoint_id for e in endpoints]
    home, nxt = ring_order("k", ids)[:2]
    down = [ep(e.endpoint_id, healthy=e.endpoint_id != home) for e in endpoints]
    d = p.select(facts("k", home), down)
    assert (d.endpoint_id, d.reason, d.session_moved_from) == (nxt, DecisionReason.AFFINITY_MOVED, home)
    tried = [e for e in endpoints if e.endpoint_id != home]  # gateway removed the failed one
    d = p.select(facts("k", home), tried)
    assert (d.endpoint_id, d.session_moved_from) == (nxt, home)
    d = p.select(facts("k", "http://gone:1"), endpoints)  # assignment to a removed endpoint
    assert (d.endpoint_id, d.session_moved_from) == (home, "http://gone:1")


def test_without_session_key_delegates_to_least_tokens() -> None:
    endpoints = [ep("a", requests=1, prefill=900), ep("b", requests=4, decode=100), ep("c", decode=400)]
    for _ in range(10):
        d = policy().select(facts(None), endpoints)
        assert (d.endpoint_id, d.reason) == ("b", DecisionReason.BALANCED)


def test_sessions_spread_evenly_and_adding_an_endpoint_moves_few() -> None:
    keys = [f"session-{i}" for i in range(2000)]
    eight, nine = fleet(8), fleet(9)
    p = policy()
    before = {k: p.select(facts(k), eight).endpoint_id for k in keys}
    counts = Counter(before.values())
    assert len(counts) == 8 and min(counts.values()) > 150 and max(counts.values()) < 370  # 250 each
    p9 = policy()
    after = {k: p9.select(facts(k), nine).endpoint_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == nine[8].endpoint_id for k in moved)  # only onto the new endpoint
    assert 120 < len(moved) < 350  # about 1/9 of 2000 = 222


def test_ring_home_is_stable_when_a_candidate_is_left_out_once() -> None:
    """The gateway drops already-tried endpoints from one call; other sessions must not move."""
    p, endpoints = policy(), fleet(6)
    keys = [f"k{i}" for i in range(300)]
    homes = {k: p.select(facts(k), endpoints).endpoint_id for k in keys}
    p.select(facts("other"), endpoints[1:])
    assert {k: p.select(facts(k), endpoints).endpoint_id for k in keys} == homes


@settings(max_examples=150, deadline=None)
@given(loads=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
       healthy=st.lists(st.booleans(), min_size=12, max_size=12),
       key=st.text(min_size=1, max_size=8), home=st.integers(0, 12),
       load_factor=st.floats(1.0, 3.0))
def test_choice_is_always_healthy_and_within_bound(loads, healthy, key, home, load_factor) -> None:
    endpoints = [ep(f"e{i}", healthy=healthy[i], decode=load) for i, load in enumerate(loads)]
    session_endpoint = endpoints[home].endpoint_id if home < len(endpoints) else None
    d = policy(load_factor=load_factor).select(facts(key, session_endpoint), endpoints)
    live = [e for e in endpoints if e.healthy]
    if not live:
        assert d is None
        return
    mean = sum(e.num_decode_tokens + 1 for e in live) / len(live)
    chosen = next(e for e in endpoints if e.endpoint_id == d.endpoint_id)
    assert chosen.healthy and chosen.num_decode_tokens + 1 <= load_factor * mean * (1 + 1e-9)
    assert (d.session_moved_from is None) == (d.reason is not DecisionReason.AFFINITY_MOVED)
    if d.reason is DecisionReason.AFFINITY_MOVED:
        assert d.session_moved_from == session_endpoint != d.endpoint_id


# --- requests without x-session-affinity: a key derived from the prompt's prefix -------------------

@pytest.mark.parametrize(("hashes", "block_size", "num_key_tokens", "expected"), [
    ((11, 12, 13, 14), 16, 32, "prefix:c"),      # the 2nd chained hash names the first 32 tokens
    ((11, 12, 13, 14), 16, 1024, "prefix:e"),    # shorter prompt: all its full blocks
    ((11, 12, 13, 14), 16, 8, "prefix:b"),       # less than a block: the first block
    ((11, 12, 13, 14), 512, 1024, "prefix:c"),   # the block size comes with the hashes
    ((), 16, 1024, None),                        # no full block: no key
    ((11, 12), 16, 0, None),                     # derivation off
])
def test_prefix_affinity_key(hashes, block_size, num_key_tokens, expected) -> None:
    assert prefix_affinity_key(hashes, block_size, num_key_tokens) == expected


def test_headerless_requests_follow_their_prefix() -> None:
    p, endpoints = policy(prefix_key_tokens=32), fleet(8)
    ids = [e.endpoint_id for e in endpoints]
    homes = set()
    for conversation in range(20):
        head = (conversation, 1000 + conversation)  # two leading blocks of this conversation
        turns = [p.select(facts(hashes=head + tail), endpoints) for tail in ((), (5,), (5, 6, 7))]
        expected = ring_order(f"prefix:{head[1]:x}", ids)[0]
        assert [(d.endpoint_id, d.reason, d.session_moved_from) for d in turns] == \
            [(expected, DecisionReason.PREFIX_AFFINITY, None)] * 3
        homes.add(expected)
    assert len(homes) > 3  # prefixes spread over the ring


def test_headerless_without_blocks_or_with_derivation_off_balances() -> None:
    endpoints = [ep("a", decode=50), ep("b", decode=10), ep("c", decode=30)]
    assert policy().select(facts(), endpoints).reason is DecisionReason.BALANCED
    d = policy(prefix_key_tokens=0).select(facts(hashes=(1, 2, 3)), endpoints)
    assert (d.endpoint_id, d.reason) == ("b", DecisionReason.BALANCED)
    with pytest.raises(ValueError):
        policy(prefix_key_tokens=-1)
    with pytest.raises(ValueError):
        policy(prefix_key_tokens=1.5)


def test_a_derived_key_respects_the_load_bound() -> None:
    p = policy(prefix_key_tokens=16)
    ids = [f"http://w{i}:8000" for i in range(4)]
    home = ring_order("prefix:7", ids)[0]
    endpoints = [ep(i, decode=10_000 if i == home else 0) for i in ids]
    d = p.select(facts(hashes=(7,)), endpoints)
    assert d.endpoint_id == ring_order("prefix:7", [i for i in ids if i != home])[0]
    assert (d.reason, d.session_moved_from) == (DecisionReason.PREFIX_AFFINITY, None)
