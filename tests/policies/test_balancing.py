"""Table-driven tests of the load-only policies: round_robin, least_requests, least_tokens,
power_of_two, and the registry that builds them."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from policies.base import DecisionReason
from policies.registry import PolicyName, make_policy
from tests.policies.helpers import ep, facts, fleet

ALL = list(PolicyName)


@pytest.mark.parametrize("name", ALL)
def test_no_usable_endpoint_gives_none(name: PolicyName) -> None:
    policy = make_policy(name, {})
    assert policy.select(facts(), []) is None
    assert policy.select(facts("s1"), fleet(3, healthy=False)) is None


@pytest.mark.parametrize("name", ALL)
def test_unhealthy_endpoints_are_never_chosen(name: PolicyName) -> None:
    policy = make_policy(name, {"seed": 1} if name is not PolicyName.ROUND_ROBIN else {})
    endpoints = fleet(6)
    endpoints[1] = ep(endpoints[1].endpoint_id, healthy=False)  # the least loaded, but down
    endpoints[4] = ep(endpoints[4].endpoint_id, healthy=False, matched=9)
    endpoints = [e if not e.healthy else ep(e.endpoint_id, requests=3, prefill=300) for e in endpoints]
    down = {endpoints[1].endpoint_id, endpoints[4].endpoint_id}
    for i in range(200):
        decision = policy.select(facts(f"s{i % 7}", hashes=(1, 2, 3)), endpoints)
        assert decision is not None and decision.endpoint_id not in down


@pytest.mark.parametrize("name", [PolicyName.LEAST_REQUESTS, PolicyName.LEAST_TOKENS,
                                  PolicyName.POWER_OF_TWO, PolicyName.PREFIX_AWARE,
                                  PolicyName.ROUND_ROBIN])
def test_ties_spread_over_all_endpoints(name: PolicyName) -> None:
    """An idle fleet: every endpoint ties. The choice must not always be the first (LiteLLM)."""
    policy = make_policy(name, {"seed": 7} if name is not PolicyName.ROUND_ROBIN else {})
    endpoints = fleet(8, requests=2, prefill=100, decode=50)
    counts = Counter(policy.select(facts(), endpoints).endpoint_id for _ in range(1600))
    assert set(counts) == {e.endpoint_id for e in endpoints}
    assert min(counts.values()) > 120  # 200 expected each; uniform with generous slack


def test_round_robin_rotates_and_skips_unhealthy() -> None:
    policy = make_policy(PolicyName.ROUND_ROBIN, {})
    endpoints = [ep("a"), ep("b", healthy=False), ep("c"), ep("d")]
    picks = [policy.select(facts(), endpoints).endpoint_id for _ in range(6)]
    assert picks == ["a", "c", "d", "a", "c", "d"]


@pytest.mark.parametrize(
    ("name", "options", "endpoints", "expected"),
    [
        # least_requests counts requests, whatever their size
        (PolicyName.LEAST_REQUESTS, {}, [ep("a", requests=1, prefill=5000), ep("b", requests=5, decode=100)], "a"),
        # least_tokens counts tokens, not requests
        (PolicyName.LEAST_TOKENS, {}, [ep("a", requests=1, prefill=5000), ep("b", requests=5, decode=100)], "b"),
        (PolicyName.LEAST_TOKENS, {}, [ep("a", prefill=100, decode=900), ep("b", prefill=990)], "b"),
        # weighting: prefill tokens are cheap here, so 1000 prefill < 200 decode
        (PolicyName.LEAST_TOKENS, {"prefill_weight": 0.1}, [ep("a", prefill=1000), ep("b", decode=200)], "a"),
        (PolicyName.LEAST_TOKENS, {"decode_weight": 0.1}, [ep("a", prefill=1000), ep("b", decode=2000)], "b"),
        # KV headroom: b is lighter but nearly full; used only when every endpoint is full
        (PolicyName.LEAST_TOKENS, {"min_kv_free_fraction": 0.1},
         [ep("a", decode=500, kv_free=0.5), ep("b", kv_free=0.01)], "a"),
        (PolicyName.LEAST_TOKENS, {"min_kv_free_fraction": 0.1},
         [ep("a", decode=500, kv_free=0.05), ep("b", kv_free=0.01)], "b"),
        # power of two with two endpoints compares exactly those two
        (PolicyName.POWER_OF_TWO, {"seed": 3}, [ep("a", decode=10), ep("b", decode=1)], "b"),
        (PolicyName.POWER_OF_TWO, {"seed": 3}, [ep("a", decode=1, requests=9), ep("b", decode=10)], "a"),
    ],
)
def test_choice_table(name: PolicyName, options: dict, endpoints: list, expected: str) -> None:
    policy = make_policy(name, options)
    for _ in range(20):
        decision = policy.select(facts(), endpoints)
        assert decision is not None
        assert (decision.endpoint_id, decision.reason, decision.session_moved_from) == (
            expected, DecisionReason.BALANCED, None)


def test_power_of_two_never_picks_the_most_loaded_and_is_seedable() -> None:
    endpoints = [ep(f"e{i}", prefill=100 * i) for i in range(8)]
    picks = [make_policy(PolicyName.POWER_OF_TWO, {"seed": 11}).select(facts(), endpoints).endpoint_id
             for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first choice
    policy = make_policy(PolicyName.POWER_OF_TWO, {"seed": 11})
    counts = Counter(policy.select(facts(), endpoints).endpoint_id for _ in range(2000))
    assert "e7" not in counts
    # P(e_i) = 2*(7-i)/56: the least loaded is chosen most, and clearly more than uniformly
    assert counts["e0"] > counts["e3"] > counts["e6"] > 0
    assert 400 < counts["e0"] < 600  # expected 500


@pytest.mark.parametrize(("name", "options", "message"), [
    (PolicyName.LEAST_TOKENS, {"prefill_wieght": 1.0}, "unknown policy option"),
    (PolicyName.LEAST_TOKENS, {"decode_weight": -1}, ">= 0"),
    (PolicyName.SESSION_AFFINITY, {"load_factor": 0.9}, ">= 1"),
    (PolicyName.SESSION_AFFINITY, {"num_virtual_nodes": 2.5}, "integer"),
    (PolicyName.POWER_OF_TWO, {"seed": "x"}, "seed"),
    (PolicyName.PREFIX_AWARE, {"block_size": 16}, "unknown policy option"),  # it comes with the request
    (PolicyName.PREFIX_AWARE, {"alpha": "high"}, "number"),
])
def test_bad_options_fail_at_start_up(name: PolicyName, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(name, options)


def test_registry_accepts_config_strings_and_rejects_unknown_names() -> None:
    assert type(make_policy("least_tokens", {})).__name__ == "LeastTokensPolicy"  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        make_policy("least_busy", {})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ALL)
def test_select_over_16_endpoints_is_fast(name: PolicyName) -> None:
    policy = make_policy(name, {})
    endpoints = [ep(f"http://w{i}:8000", requests=i % 3, prefill=97 * i % 500, decode=31 * i % 300,
                    matched=i % 4) for i in range(16)]
    request = facts("session-42", hashes=(1, 2, 3, 4))
    policy.select(request, endpoints)  # builds the hash ring once
    n = 2000
    start = time.process_time()  # CPU time: other processes on a busy CI box do not count
    for _ in range(n):
        policy.select(request, endpoints)
    per_call_us = (time.process_time() - start) / n * 1e6
    assert per_call_us < 60, per_call_us  # 2-8 µs measured; the bound catches an accidental O(n²)/rebuild
