"""`select_fleet` (a FleetView kept current, the prefix index's levels) against `select` over every endpoint's
state: the same decision, up to the random choice among endpoints of equal score."""
from __future__ import annotations

import math
from unittest import mock

from hypothesis import given, settings, strategies as st

from cache.kv_events import CPU, DISK, STORE
from cache.prefix_index import PrefixIndex
from cache.tier_runs import PromptTiers
from policies import fleet_view
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
    if not any(s.num_matched_blocks or any(s.num_tier_matched_blocks) for s in within):
        within = [s for s in states if s.healthy]
        scores = {s.endpoint_id: s.num_prefill_tokens + s.num_decode_tokens for s in within}
    else:
        scores = {s.endpoint_id: policy._negative_score(s, block_size) for s in within}
    least = min(scores.values())
    return {e for e, score in scores.items() if score == least}


@settings(max_examples=300, deadline=None)
@given(specs=endpoint_specs, alpha=st.sampled_from([0.5, 0.05, 2.0]), load_factor=st.sampled_from([1.0, 1.5, 4.0]),
       block_size=st.sampled_from([4, 16]), seed=st.integers(0, 3), key_tokens=st.sampled_from([0, 0, 16, 64]))
def test_prefix_aware_fleet_picks_a_best_endpoint(specs, alpha, load_factor, block_size, seed, key_tokens) -> None:
    """With `prefix_key_tokens`, a prompt no endpoint within the bound holds as far as its key goes to the key's
    ring home within the bound, the same endpoint either way."""
    states, view, index = build(specs)
    options = {"seed": seed, "alpha": alpha, "load_factor": load_factor, "prefix_key_tokens": key_tokens}
    fast_policy, slow_policy = (make_policy(PolicyName.PREFIX_AWARE, options) for _ in range(2))
    facts = request(block_size)
    fast = fast_policy.select_fleet(facts, view, index.matched_levels(PROMPT))
    slow = slow_policy.select(facts, states)
    if slow is None:
        assert fast is None
        return
    assert fast is not None
    if slow.reason is DecisionReason.PREFIX_AFFINITY or fast.reason is DecisionReason.PREFIX_AFFINITY:
        assert fast == slow
        return
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


tier_specs = st.lists(st.tuples(
    st.sampled_from([0, 0, 0, 1, 3]),                # blocks of its own past its device run in a tier (0: none)
    st.sampled_from([CPU, DISK, STORE]),             # which tier (STORE: a store it names to no one else)
    st.sampled_from([None, "s1", "s1", "s2"]),       # the shared store it reads
    st.sampled_from([None, 0.0, 0.05, 0.5, 1.2]),    # its measured restore fraction (None: none reported)
), min_size=70, max_size=70)
store_contents = st.lists(st.integers(0, len(PROMPT) - 1), max_size=len(PROMPT))   # prompt blocks a store holds


@settings(max_examples=800, deadline=None)
@given(specs=endpoint_specs, tiers=tier_specs, s1=store_contents, s2=store_contents,
       measured=st.booleans(), alpha=st.sampled_from([0.5, 0.05, 2.0]), load_factor=st.sampled_from([1.0, 1.5, 4.0]),
       block_size=st.sampled_from([4, 16]), seed=st.integers(0, 3), few=st.sampled_from([0, 64]))
def test_prefix_aware_fleet_with_kv_tiers_picks_a_best_endpoint(specs, tiers, s1, s2, measured, alpha, load_factor,
                                                                 block_size, seed, few) -> None:
    """Endpoints holding tier blocks of their own and readers of two shared stores (holding any of the prompt's
    blocks, leading or not), with measured or fixed weights: `select_fleet` through `PromptTiers` picks an endpoint
    of least score, as `select` over every endpoint's state by medium does; a store's readers searched bucket by
    bucket (`few` 0) or sorted."""
    with mock.patch.object(fleet_view, "_FEW_MEMBERS", few):
        check_tiered(specs, tiers, s1, s2, measured, alpha, load_factor, block_size, seed)


def check_tiered(specs, tiers, s1, s2, measured, alpha, load_factor, block_size, seed) -> None:
    _, view, index = build(specs)
    ids = list(view.member_ids)
    tiers = tiers[:len(ids)]
    fractions = {}
    for endpoint_id, (run, *_), (num_own, medium, store, fraction) in zip(ids, specs, tiers, strict=True):
        if store is not None:
            index.share_store(endpoint_id, store)
        if num_own:
            index.store(endpoint_id, PROMPT[run:run + num_own], medium)
        fractions[endpoint_id] = (None, None, None) if fraction is None else (fraction, fraction, fraction)
    for key, blocks in (("s1", s1), ("s2", s2)):
        reader = next((e for e, t in zip(ids, tiers, strict=True) if t[2] == key), None)
        if reader is not None:
            index.store(reader, [PROMPT[i] for i in blocks], STORE)
    view.tiered_mask = index.tiered_mask
    by_medium = index.matched_blocks_by_medium(PROMPT)
    states = []
    for endpoint_id, (run, prefill, decode, healthy, _) in zip(ids, specs, strict=True):
        matched = by_medium.get(endpoint_id, (0, 0, 0, 0))
        assert matched[0] == run
        states.append(EndpointState(endpoint_id, healthy, 0, prefill, decode, run, None, matched[1:],
                                    fractions[endpoint_id] if any(matched[1:]) else (None, None, None)))
    options = {"seed": seed, "alpha": alpha, "load_factor": load_factor, "measured_tier_weights": measured}
    fast_policy, slow_policy = (make_policy(PolicyName.PREFIX_AWARE, options) for _ in range(2))
    facts = request(block_size)
    prompt_tiers = PromptTiers(index, PROMPT, fractions.__getitem__)
    fast = fast_policy.select_fleet(facts, view, index.matched_levels(PROMPT), prompt_tiers)
    slow = slow_policy.select(facts, states)
    if slow is None:
        assert fast is None
        return
    assert fast is not None
    best = best_prefix_aware(slow_policy, states, block_size)
    assert slow.endpoint_id in best and fast.endpoint_id in best
    held = {s.endpoint_id: s.num_matched_blocks + sum(s.num_tier_matched_blocks) for s in states}
    assert fast.reason is (DecisionReason.PREFIX_HIT if held[fast.endpoint_id] else DecisionReason.BALANCED)


def test_a_store_read_by_every_endpoint_is_searched_by_load_not_visited_whole() -> None:
    """1,000 readers of one store holding the prompt: the least loaded of them wins, found by visiting a few."""
    index, view = PrefixIndex(), FleetView([f"e{i}" for i in range(1000)])
    for i, endpoint_id in enumerate(view.member_ids):
        index.share_store(endpoint_id, "s")
        view.put(endpoint_id, index.endpoint_bit(endpoint_id), 1000 + 37 * i % 5000, 0)
    index.store("e3", PROMPT, STORE)
    view.tiered_mask = index.tiered_mask
    visited = []

    def fractions(endpoint_id: str) -> tuple[None, None, float]:
        visited.append(endpoint_id)
        return (None, None, 0.1)

    policy = make_policy(PolicyName.PREFIX_AWARE, {"seed": 0})
    decision = policy.select_fleet(request(), view, index.matched_levels(PROMPT), PromptTiers(index, PROMPT, fractions))
    least = min(view.loads, key=lambda e: view.loads[e][0])
    assert decision is not None and decision.endpoint_id == least and decision.reason is DecisionReason.PREFIX_HIT
    assert 0 < len(visited) < 50


def test_a_reader_whose_store_reads_are_measured_cheap_wins_over_a_less_loaded_one() -> None:
    """The store search's bound takes a store block at its most worth (1 with measured weights): a reader that
    measured its restores nearly free (weight 1) beats a less loaded one at the fixed weight (0.3), though it
    sits a load bucket higher."""
    index, view = PrefixIndex(), FleetView(["a", "b", "c", "d"])
    for endpoint_id, load in (("a", 0), ("b", 100), ("c", 300), ("d", 300)):
        if endpoint_id in "ab":
            index.share_store(endpoint_id, "s")
        view.put(endpoint_id, index.endpoint_bit(endpoint_id), load, 0)
    index.store("a", PROMPT, STORE)
    view.tiered_mask = index.tiered_mask
    fractions = {"a": (None, None, None), "b": (None, None, 0.0)}
    policy = make_policy(PolicyName.PREFIX_AWARE, {"seed": 0})   # alpha 0.5: a: 0 - 0.3 x 96, b: 50 - 96
    decision = policy.select_fleet(request(), view, index.matched_levels(PROMPT),
                                   PromptTiers(index, PROMPT, fractions.__getitem__))
    assert decision is not None and decision.endpoint_id == "b"


def test_endpoints_with_tiers_of_their_own_are_searched_by_load_not_visited_whole() -> None:
    """1,000 endpoints, each with the prompt's blocks in its host RAM: the least loaded wins, and only a few of
    them are looked up."""
    index, view = PrefixIndex(), FleetView([f"e{i}" for i in range(1000)])
    for i, endpoint_id in enumerate(view.member_ids):
        index.store(endpoint_id, PROMPT, CPU)
        view.put(endpoint_id, index.endpoint_bit(endpoint_id), 1000 + 37 * i % 5000, 0)
    view.tiered_mask = index.tiered_mask
    looked_up = []

    class Counted(PromptTiers):
        def matched(self, endpoint_id: str, num_device: int) -> tuple[int, int, int, int]:
            looked_up.append(endpoint_id)
            return super().matched(endpoint_id, num_device)

    policy = make_policy(PolicyName.PREFIX_AWARE, {"seed": 0})
    tiers = Counted(index, PROMPT, lambda endpoint_id: (0.05, None, None))
    decision = policy.select_fleet(request(), view, index.matched_levels(PROMPT), tiers)
    least = min(view.loads, key=lambda e: view.loads[e][0])
    assert decision is not None and decision.endpoint_id == least and decision.reason is DecisionReason.PREFIX_HIT
    assert 0 < len(looked_up) < 50
