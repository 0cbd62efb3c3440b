"""Which decode workers take a prefill worker's KV (gateway/upstream/providers/pd_pairs.py): by the weights the workers
report, and by refusals remembered until they expire or either worker reports other weights."""
from __future__ import annotations

from gateway.config.gateway_config import BreakerConfig
from gateway.routing.endpoints import CircuitBreaker, Endpoint
from gateway.upstream.providers.pd_pairs import PdPairs


def endpoint(name: str, weights: str = "") -> Endpoint:
    e = Endpoint(name, CircuitBreaker(name, BreakerConfig()))
    e.weights = weights
    return e


def names(endpoints: list[Endpoint]) -> list[str]:
    return [e.endpoint_id for e in endpoints]


def test_reported_weights_pass_over_decode_workers_of_other_weights() -> None:
    pairs = PdPairs()
    d_same, d_other, d_unknown = endpoint("same", "a"), endpoint("other", "b"), endpoint("unknown")
    assert names(pairs.takers(endpoint("p", "a"), [d_same, d_other, d_unknown], now=0.0)) == ["same", "unknown"]
    assert names(pairs.takers(endpoint("p"), [d_same, d_other, d_unknown], now=0.0)) == ["same", "other", "unknown"]


def test_a_refusal_is_remembered_per_pair_until_it_expires() -> None:
    pairs = PdPairs(ttl_s=60.0)
    p1, p2, d1, d2 = endpoint("p1"), endpoint("p2"), endpoint("d1"), endpoint("d2")
    assert pairs.refuse(p1, d1, now=100.0)            # new: the caller logs it
    assert not pairs.refuse(p1, d1, now=110.0)        # known: not logged again; remembered until 170
    assert names(pairs.takers(p1, [d1, d2], now=169.0)) == ["d2"]
    assert names(pairs.takers(p2, [d1, d2], now=169.0)) == ["d1", "d2"]   # another prefill worker's KV
    assert names(pairs.takers(p1, [d1, d2], now=170.0)) == ["d1", "d2"]   # expired
    assert pairs.refuse(p1, d1, now=171.0)            # so a new refusal is news again


def test_a_refusal_is_forgotten_when_either_worker_reports_other_weights() -> None:
    pairs = PdPairs(ttl_s=60.0)
    p1, d1 = endpoint("p1", "a"), endpoint("d1")
    pairs.refuse(p1, d1, now=0.0)
    assert pairs.takers(p1, [d1], now=1.0) == []
    d1.weights = "a"                                  # restarted on the prefill worker's revision
    assert names(pairs.takers(p1, [d1], now=2.0)) == ["d1"]
    pairs.refuse(p1, d1, now=3.0)
    p1.weights = "b"                                  # the prefill worker moved on: now it is the weights that differ
    assert pairs.takers(p1, [d1], now=4.0) == []
    d1.weights = "b"
    assert names(pairs.takers(p1, [d1], now=5.0)) == ["d1"]
