"""`select_fleet` (a FleetView kept current, the prefix index's levels) against `select` over every endpoint's
state: the same decision, up to the random choice among endpoints of equal score."""
from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from cache.prefix_index import PrefixIndex
from policies.base import DecisionReason, EndpointState, RequestFacts, TokenWeights, within_load_bound
from policies.fleet_view import FleetView
from policies.registry import PolicyName, make_policy

PROMPT = (11, 12, 13, 14, 15, 16)

endpoint_specs = st.lists(st.tuples(
    st.integers(0, 6),                           # its device run of PROMPT
    st.sampled_from([0, 8, 16, 50, 100, 400]),   # prefill tokens in flight (few values: ties)
    st.sampled_from([0, 10, 32, 64, 300]),       # decode tokens in flight
    st.booleans(),                               # healthy
    st.sampled_from([0, 0, 7, 120]),             # its load before the last change (the view is updated)
), min_size=1, max_size=70)


def build(specs: list[tuple[int, int, int, bool, int]]) -> tuple[list[EndpointState], FleetView, PrefixIndex]:
    index = PrefixIndex()
    ids = [f"http://w{i}:8000" for i in range(len(specs))]
    view = FleetView(ids)
    states = []
    for endpoint_id, (run, prefill, decode, healthy, before) in zip(ids, specs, strict=True):
        index.store(endpoint_id, PROMPT[:run])
        index.store(endpoint_id, (1000 + run,))   # a block of another prompt
        bit = index.endpoint_bit(endpoint_id)
        view.put(endpoint_id, bit, before, before)   # a stale load, then the current one
        if healthy:
            view.put(endpoint_id, bit, prefill, decode)
        else:
            view.discard(endpoint_id)
        states.append(EndpointState(endpoint_id, healthy, 0, prefill, decode, run, None))
    return states, view, index


def request(block_size: int = 16, session_key: str | None = None, home: str | None = None) -> RequestFacts:
    return RequestFacts("m", 100, 50, PROMPT, session_key, home, block_size)


def best_prefix_aware(policy, states: list[EndpointState], block_size: int) -> set[str]:
    """Every endpoint `select` may pick: the least negative score within the bound, or (nothing cached within it)
    the least loaded healthy endpoints."""
    within = within_load_bound(states, policy._weights, policy._config.load_factor)
    if not any(s.num_matched_blocks for s in within):
        within = [s for s in states if s.healthy]
        scores = {s.endpoint_id: s.num_prefill_tokens + s.num_decode_tokens for s in within}
    else:
        scores = {s.endpoint_id: policy._negative_score(s, block_size) for s in within}
    least = min(scores.values())
    return {e for e, score in scores.items() if score == least}


@settings(max_examples=300, deadline=None)
@given(specs=endpoint_specs, alpha=st.sampled_from([0.5, 0.05, 2.0]), load_factor=st.sampled_from([1.0, 1.5, 4.0]),
       block_size=st.sampled_from([4, 16]), seed=st.integers(0, 3))
def test_prefix_aware_fleet_picks_a_best_endpoint(specs, alpha, load_factor, block_size, seed) -> None:
    states, view, index = build(specs)
    options = {"seed": seed, "alpha": alpha, "load_factor": load_factor}
    fast_policy, slow_policy = (make_policy(PolicyName.PREFIX_AWARE, options) for _ in range(2))
    facts = request(block_size)
    fast = fast_policy.select_fleet(facts, view, index.matched_levels(PROMPT))
    slow = slow_policy.select(facts, states)
    if slow is None:
        assert fast is None
        return
    assert fast is not None
    best = best_prefix_aware(slow_policy, states, block_size)
    assert slow.endpoint_id in best and fast.endpoint_id in best
    runs = {s.endpoint_id: s.num_matched_blocks for s in states}
    assert fast.reason is (DecisionReason.PREFIX_HIT if runs[fast.endpoint_id] else DecisionReason.BALANCED)
    if len(best) == 1:
        assert fast == slow


@settings(max_examples=300, deadline=None)
@given(specs=endpoint_specs, load_factor=st.sampled_from([1.0, 1.25, 2.0]), keyed=st.sampled_from(["s", "p", None]),
       home=st.integers(0, 80), seed=st.integers(0, 1000))
def test_session_affinity_fleet_decides_as_select(specs, load_factor, keyed, home, seed) -> None:
    states, view, index = build(specs)
    options = {"load_factor": load_factor, "seed": 0, "prefix_key_tokens": 0 if keyed is None else 32}
    fast_policy, slow_policy = (make_policy(PolicyName.SESSION_AFFINITY, options) for _ in range(2))
    home_id = states[home].endpoint_id if home < len(states) else None
    facts = request(16, f"session-{seed}" if keyed == "s" else None, home_id if keyed == "s" else None)
    fast = fast_policy.select_fleet(facts, view, index.matched_levels(PROMPT))
    slow = slow_policy.select(facts, states)
    if keyed is None:   # least tokens: any of the least loaded healthy endpoints
        healthy = {s.endpoint_id: s.num_prefill_tokens + s.num_decode_tokens for s in states if s.healthy}
        if not healthy:
            assert fast is None and slow is None
            return
        least = min(healthy.values())
        assert fast is not None and healthy[fast.endpoint_id] == least and fast.reason is slow.reason
        return
    assert fast == slow


def test_pick_least_shares_ties() -> None:
    view = FleetView(["a", "b", "c"])
    for bit, endpoint_id in enumerate("abc"):
        view.put(endpoint_id, 1 << bit, 0, 5 if endpoint_id == "c" else 0)
    policy = make_policy(PolicyName.LEAST_TOKENS, {"seed": 1})
    picks = {policy.select_fleet(request(), view, ()).endpoint_id for _ in range(50)}
    assert picks == {"a", "b"}


load_steps = st.lists(st.lists(st.tuples(
    st.integers(0, 11),                                   # which endpoint
    st.sampled_from([None, 0, 5, 63, 64, 130, 1000]),     # its prefill tokens now (None: not usable)
    st.sampled_from([0, 7, 64, 500]),                     # its decode tokens now
), max_size=8), max_size=12)


@settings(max_examples=200, deadline=None)
@given(steps=load_steps)
def test_batched_upkeep_leaves_the_view_a_rebuilt_one_would_be(steps) -> None:
    """`put_many` (the live view's upkeep per decision) against a view built afresh from the same loads: the same
    sums, the same orderings bucket by bucket, the same least loaded endpoints."""
    ids = [f"e{i}" for i in range(12)]
    weightings = [TokenWeights(1.0, 1.0), TokenWeights(2.0, 0.5)]
    view, current = FleetView(ids), {}
    for weights in weightings:   # orderings made before the loads come: kept by every batch from here on
        assert view.least(weights, -1, math.inf) == []
    for step in steps:
        updates: dict[str, tuple[int, int]] = {}
        for i, num_prefill, num_decode in step:
            if num_prefill is None:
                view.discard(ids[i])
                current.pop(ids[i], None)
                updates.pop(ids[i], None)
            else:
                updates[ids[i]] = (num_prefill, num_decode)
        view.put_many([(e, 1 << ids.index(e), p, d) for e, (p, d) in updates.items()])
        current.update(updates)
        fresh = FleetView(ids)
        for endpoint_id, (num_prefill, num_decode) in current.items():
            fresh.put(endpoint_id, 1 << ids.index(endpoint_id), num_prefill, num_decode)
        assert (view.loads, view.bit_of, view.id_of_bit, view.usable_mask, view.sum_prefill, view.sum_decode) == (
            fresh.loads, fresh.bit_of, fresh.id_of_bit, fresh.usable_mask, fresh.sum_prefill, fresh.sum_decode)
        for weights in weightings:
            kept, rebuilt = view._order(weights), fresh._order(weights)
            assert (kept.bucket_of, kept.buckets, kept.nonempty) == (rebuilt.bucket_of, rebuilt.buckets,
                                                                     rebuilt.nonempty)
            for mask in (-1, 0b101010101010, 0b11):
                for bound in (math.inf, 100.0, 700.0):
                    assert sorted(view.least(weights, mask, bound)) == sorted(fresh.least(weights, mask, bound))
