"""gateway/routing/live_pools.py through `Legs.choose`: a large pool's live view gives the decisions that listing
every candidate gives, as leases, health, circuits and stale figures change; where it cannot (a tried endpoint, a
half-open circuit) the candidates are listed."""
from __future__ import annotations

import math
import random

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from cache.kv_events import CPU, DISK, STORE
from cache.prefix_index import PrefixIndex
from gateway.config.gateway_config import parse_config
from gateway.routing.endpoints import CircuitState, UpstreamRegistry
from gateway.routing.load import DEFAULT_RESTORE_FRACTIONS, LoadReport, LoadTracker
from gateway.state.memory import MemoryStore
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import Tracing
from gateway.upstream.legs import Legs
from gateway.upstream.request import Progress, RoutedRequest
from policies.base import DecisionReason, RequestFacts
from policies.registry import PolicyName, make_policy
from tests.support.clock import ManualClock

NUM_ENDPOINTS = 40
PROMPT = (21, 22, 23, 24)


class Gateway:
    def __init__(self) -> None:
        urls = [f"http://w{i}:8000" for i in range(NUM_ENDPOINTS)]
        self.config = parse_config(orjson.dumps({"models": {"m": {"providers": ["p"]}},
                                                 "providers": {"p": {"endpoints": urls}}}).decode(), {})
        self.clock = ManualClock()
        self.tracker, self.index = LoadTracker(clock=self.clock), PrefixIndex()
        self.registry = UpstreamRegistry(self.config, self.tracker, self.index)
        self.pool = self.registry.pool("p")
        for endpoint in self.pool:   # the registry's breakers read the real clock: these read the test's
            endpoint.breaker._clock = self.clock
        self.legs = Legs(None, self.registry, self.tracker, self.index, MemoryStore(), Metrics(tuple),  # type: ignore[arg-type]
                         Tracing(self.config.tracing), 0.0)

    def choose(self, policy_name: PolicyName, live: bool, session: str | None = None, tried: set[str] | None = None,
               key_tokens: int = 0):
        self.legs.live_pools.min_endpoints = 32 if live else math.inf
        facts = RequestFacts("m", 64, 16, PROMPT, session, None, 16)
        model = self.config.models["m"]
        request = RoutedRequest(model, "/v1/chat/completions", {}, b"", False, facts, "r", 0.0, session)
        options = {"seed": 0} if policy_name is PolicyName.LEAST_TOKENS else {"seed": 0, "load_factor": 1.25}
        if policy_name is PolicyName.PREFIX_AWARE:
            options["prefix_key_tokens"] = key_tokens
        policy = make_policy(policy_name, options)
        progress = Progress(request, None, policy, tried=tried or set())
        return self.legs.choose(progress, self.pool, policy)


def distinct_loads(gateway: Gateway, rng: random.Random) -> None:
    """Leases of distinct sizes (no ties: both ways must then pick the same endpoint)."""
    sizes = rng.sample(range(1, 10_000), NUM_ENDPOINTS)
    for endpoint, size in zip(gateway.pool, sizes, strict=True):
        gateway.tracker.lease(endpoint.endpoint_id, size, 7)


def hold_in_tiers(gateway: Gateway, rng: random.Random, tiers: str | None) -> None:
    """"local": a few endpoints hold the prompt's next blocks in host RAM or on disk past their device run;
    "store": every endpoint reads one shared store, which one of them filled with the prompt's first blocks."""
    if tiers == "local":
        for endpoint in rng.sample(gateway.pool, 5):
            run = gateway.index.num_matched_blocks(endpoint.endpoint_id, PROMPT)
            gateway.index.store(endpoint.endpoint_id, PROMPT[run:run + rng.randrange(1, 4)], rng.choice([CPU, DISK]))
    elif tiers == "store":
        for endpoint in gateway.pool:
            gateway.index.share_store(endpoint.endpoint_id, "the-store")
        gateway.index.store(gateway.pool[rng.randrange(NUM_ENDPOINTS)].endpoint_id, PROMPT[:3], STORE)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), session=st.sampled_from([None, "conversation-1"]),
       policy_name=st.sampled_from([PolicyName.PREFIX_AWARE, PolicyName.SESSION_AFFINITY, PolicyName.LEAST_TOKENS]),
       tiers=st.sampled_from([None, "local", "store"]), key_tokens=st.sampled_from([0, 32]))
def test_live_view_decides_as_the_listed_candidates(seed, session, policy_name, tiers, key_tokens) -> None:
    rng = random.Random(seed)
    gateway = Gateway()
    distinct_loads(gateway, rng)
    for endpoint in rng.sample(gateway.pool, 6):
        gateway.index.store(endpoint.endpoint_id, PROMPT[:rng.randrange(1, 5)])
    hold_in_tiers(gateway, rng, tiers)
    gateway.choose(policy_name, live=True)   # the view is built, then kept current from here
    gateway.pool[rng.randrange(NUM_ENDPOINTS)].healthy = False
    for _ in range(5):
        gateway.pool[rng.randrange(NUM_ENDPOINTS)].breaker.on_failure()
    held = gateway.pool[rng.randrange(NUM_ENDPOINTS)]
    held.breaker.hold_off(5.0)
    gateway.tracker.reconcile(gateway.pool[0].endpoint_id, LoadReport(0, 0, 50_000, 0, 10, 10, 0, 16))
    gateway.tracker.lease(gateway.pool[1].endpoint_id, rng.randrange(1, 10_000), 3)
    for _ in range(3):   # the report, the hold-off, then nothing stale: each moment decided alike
        live, listed = (gateway.choose(policy_name, live=way, session=session, key_tokens=key_tokens)
                        for way in (True, False))
        if policy_name is PolicyName.PREFIX_AWARE and live.decision != listed.decision:
            assert_tied(gateway, live.decision.endpoint_id, listed.decision.endpoint_id)
        else:
            assert (live.endpoint.endpoint_id, live.decision, live.prefill_work) == (
                listed.endpoint.endpoint_id, listed.decision, listed.prefill_work)
        gateway.clock.now += 3.0


def assert_tied(gateway: Gateway, one: str, other: str) -> None:
    """Distinct loads rule out ties of load, not of prefix-aware scores (a run of 2 blocks offsets 64 tokens of
    load): two picks that differ must score alike, and each may be drawn."""
    policy = make_policy(PolicyName.PREFIX_AWARE, {"load_factor": 1.25})
    matched = gateway.index.matched_blocks_by_medium(PROMPT)
    scores = {e: policy._negative_score(gateway.legs._state(e, matched), 16) for e in (one, other)}
    assert scores[one] == scores[other]


def test_circuits_and_tried_endpoints() -> None:
    gateway = Gateway()
    distinct_loads(gateway, random.Random(1))
    least = min(gateway.pool, key=lambda e: gateway.tracker.snapshot(e.endpoint_id)[1])
    assert gateway.legs.live_pools.view_for(gateway.pool, ()) is not None
    assert gateway.choose(PolicyName.LEAST_TOKENS, live=True).endpoint is least
    for _ in range(gateway.config.breaker.failure_threshold):
        least.breaker.on_failure()
    assert least.breaker.state is CircuitState.OPEN
    assert gateway.choose(PolicyName.LEAST_TOKENS, live=True).endpoint is not least
    gateway.clock.now += gateway.config.breaker.cooldown_s + 1   # half-open: a probe may go there
    assert gateway.legs.live_pools.view_for(gateway.pool, ()) is None
    assert gateway.choose(PolicyName.LEAST_TOKENS, live=True).endpoint is least
    least.breaker.on_success()
    assert gateway.legs.live_pools.view_for(gateway.pool, ()) is not None
    assert gateway.legs.live_pools.view_for(gateway.pool, {least.endpoint_id}) is None   # tried: listed
    chosen = gateway.choose(PolicyName.LEAST_TOKENS, live=True, tried={least.endpoint_id})
    assert chosen.endpoint is not least


@pytest.mark.parametrize("num_endpoints", [8])
def test_small_pools_are_listed(num_endpoints) -> None:
    gateway = Gateway()
    assert gateway.legs.live_pools.view_for(gateway.pool[:num_endpoints], ()) is None


@pytest.mark.parametrize("policy_name", [PolicyName.SESSION_AFFINITY, PolicyName.LEAST_TOKENS])
def test_policies_that_read_no_levels_skip_the_walk(policy_name, monkeypatch) -> None:
    """Session affinity and least tokens decide without the prompt's levels: the index is not walked for them, and
    the pick's cached run (its lease's uncached tokens) is its own lookup, the same as listing gives."""
    gateway = Gateway()
    distinct_loads(gateway, random.Random(2))
    for k, endpoint in enumerate(gateway.pool):   # every endpoint holds a run of its own length
        gateway.index.store(endpoint.endpoint_id, PROMPT[:k % (len(PROMPT) + 1)])
    walks: list[tuple[int, ...]] = []
    walk = gateway.index.matched_levels
    monkeypatch.setattr(gateway.index, "matched_levels", lambda hashes: walks.append(hashes) or walk(hashes))
    for session in (None, "conversation-1", "conversation-2"):
        live, listed = gateway.choose(policy_name, live=True, session=session), gateway.choose(
            policy_name, live=False, session=session)
        assert (live.endpoint, live.decision, live.prefill_work) == (
            listed.endpoint, listed.decision, listed.prefill_work)
    assert walks == []
    gateway.choose(PolicyName.PREFIX_AWARE, live=True)   # a policy that reads the levels walks them once
    assert walks == [PROMPT]


@pytest.mark.parametrize("tiers", ["local", "store"])
def test_tiered_pools_are_live(tiers, monkeypatch) -> None:
    """Endpoints holding KV tier blocks (or reading a shared store that does) still decide on the live view, listing
    no candidate, as listing decides, and the pick's lease counts its tier blocks at their restore cost as listing gives
    (prefix-aware routing, which scores those blocks, searches their holders by load)."""
    gateway = Gateway()
    distinct_loads(gateway, random.Random(3))
    for endpoint in gateway.pool:   # every endpoint: the prompt's next block in RAM, or the store's three
        if tiers == "local":
            gateway.index.store(endpoint.endpoint_id, PROMPT[:1], CPU)
        else:
            gateway.index.share_store(endpoint.endpoint_id, "the-store")
    if tiers == "store":
        gateway.index.store(gateway.pool[5].endpoint_id, PROMPT[:3], STORE)
    listings: list[object] = []
    listed_walk = gateway.index.matched_blocks_by_medium
    monkeypatch.setattr(gateway.index, "matched_blocks_by_medium",
                        lambda hashes: listings.append(hashes) or listed_walk(hashes))
    held = (1 if tiers == "local" else 3) * 16
    medium = 0 if tiers == "local" else 2   # in DEFAULT_RESTORE_FRACTIONS: (cpu, disk, store)
    cases = [(PolicyName.SESSION_AFFINITY, 0), (PolicyName.LEAST_TOKENS, 0), (PolicyName.PREFIX_AWARE, 0),
             (PolicyName.PREFIX_AWARE, 16), (PolicyName.PREFIX_AWARE, 16 * 2),
             (PolicyName.PREFIX_AWARE, 16 * 4)]   # a key of 1 block, of 2, of 4
    for policy_name, key_tokens in cases:
        for session in (None, "conversation-1"):
            live = gateway.choose(policy_name, live=True, session=session, key_tokens=key_tokens)
            assert listings == []
            listed = gateway.choose(policy_name, live=False, session=session, key_tokens=key_tokens)
            assert (live.endpoint, live.decision, live.prefill_work) == (
                listed.endpoint, listed.decision, listed.prefill_work)
            if key_tokens:   # a prompt none holds as much of as its key covers goes to the key's home
                cold = key_tokens > held
                assert (live.decision.reason is DecisionReason.PREFIX_AFFINITY) == cold, (key_tokens, live.decision)
            # nothing measured: each held token read back at the default guess of its medium's cost
            assert live.prefill_work == 64 - held + round(held * DEFAULT_RESTORE_FRACTIONS[medium])
            listings.clear()
