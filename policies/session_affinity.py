"""Session affinity by consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
2018): a session stays where it is while that endpoint's load is within `load_factor` x the mean,
else it walks the hash ring to the first endpoint within the bound. A request without a session key
is keyed by its prompt's prefix (`prefix_affinity_key`), so clients that send no header still land
where their prefix is warm; with neither (no full block, or `prefix_key_tokens: 0`): least_tokens.
"""
from __future__ import annotations

import bisect
import hashlib
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import (
    Decision,
    DecisionReason,
    EndpointState,
    RequestFacts,
    TokenWeights,
    check_number,
    check_seed,
    config_from_options,
    prefix_affinity_key,
    within_load_bound,
)
from policies.fleet_view import FleetView, Levels, TierMatches, WithinBound
from policies.least_tokens import LeastTokensConfig, LeastTokensPolicy

# Past this many distinct endpoint ids the ring is rebuilt from the current candidates only,
# so a churning fleet cannot grow it without bound.
MAX_RING_ENDPOINTS = 1024


@dataclass(frozen=True, slots=True)
class SessionAffinityConfig:
    load_factor: float = 1.25    # c: an endpoint takes a session while its load <= c x mean load
    num_virtual_nodes: int = 100  # ring points per endpoint (more: smoother spread, slower rebuild)
    prefill_weight: float = 1.0  # load = weighted tokens in flight + 1 (also the fallback's weights)
    decode_weight: float = 1.0
    seed: int | None = None      # seeds the fallback's tie-breaking RNG (tests)
    prefix_key_tokens: int = 1024  # no session header: key by this many leading prompt tokens (0: off)

    def __post_init__(self) -> None:
        check_number("load_factor", self.load_factor, minimum=1.0)
        check_number("prefix_key_tokens", self.prefix_key_tokens, minimum=0)
        if not isinstance(self.prefix_key_tokens, int):
            raise ValueError("policy option 'prefix_key_tokens' must be an integer")
        check_number("num_virtual_nodes", self.num_virtual_nodes, minimum=1)
        if not isinstance(self.num_virtual_nodes, int):
            raise ValueError("policy option 'num_virtual_nodes' must be an integer")
        TokenWeights(self.prefill_weight, self.decode_weight)
        check_seed(self.seed)


def ring_hash(key: str) -> int:
    """64-bit stable hash of a ring key (the same in every gateway replica and process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class HashRing:
    """Consistent-hash ring of endpoint ids with virtual nodes."""

    def __init__(self, endpoint_ids: Sequence[str], num_virtual_nodes: int) -> None:
        self.endpoint_ids = frozenset(endpoint_ids)
        self._num_virtual_nodes = num_virtual_nodes
        points = sorted((ring_hash(f"{eid}#{i}"), eid)
                        for eid in self.endpoint_ids for i in range(num_virtual_nodes))
        self._points = [p for p, _ in points]
        self._owners = [eid for _, eid in points]

    def grown(self, endpoints: Sequence[EndpointState]) -> HashRing:
        """This ring, or a new one with the endpoints it has not seen added; ids seen before stay, so a
        key's ring home does not move when a candidate is left out of one call (already tried, unhealthy)."""
        return self.grown_ids(e.endpoint_id for e in endpoints)

    def grown_ids(self, endpoint_ids: Iterable[str]) -> HashRing:
        """`grown`, from endpoint ids."""
        ids = list(endpoint_ids)
        known = self.endpoint_ids
        if all(eid in known for eid in ids):
            return self
        union = known.union(ids)
        if len(union) > MAX_RING_ENDPOINTS:
            union = frozenset(ids)
        return HashRing(sorted(union), self._num_virtual_nodes)

    def first(self, key_hash: int, accept: Container[str]) -> str | None:
        """The first endpoint clockwise from `key_hash` whose id is in `accept`."""
        start = bisect.bisect_right(self._points, key_hash)
        n = len(self._owners)
        for k in range(n):
            eid = self._owners[(start + k) % n]
            if eid in accept:
                return eid
        return None


class SessionAffinityPolicy:
    def __init__(self, config: SessionAffinityConfig | None = None) -> None:
        config = config or SessionAffinityConfig()
        self._config = config
        self._weights = TokenWeights(config.prefill_weight, config.decode_weight)
        self._fallback = LeastTokensPolicy(LeastTokensConfig(
            prefill_weight=config.prefill_weight, decode_weight=config.decode_weight,
            seed=config.seed))
        self._ring = HashRing((), config.num_virtual_nodes)
        self._grown_from: tuple[str, ...] | None = None   # the fleet members the ring last grew by

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SessionAffinityPolicy:
        return cls(config_from_options(SessionAffinityConfig, options))

    def select(self, request: RequestFacts, endpoints: Sequence[EndpointState]) -> Decision | None:
        key = request.session_key
        if key is None:
            key = prefix_affinity_key(request.block_hashes, request.block_size, self._config.prefix_key_tokens)
            if key is None:
                return self._fallback.select(request, endpoints)
            return self._ring_home(key, endpoints, None, derived=True)
        return self._ring_home(key, endpoints, request.session_endpoint, derived=False)

    def _ring_home(self, key: str, endpoints: Sequence[EndpointState], home: str | None,
                   derived: bool) -> Decision | None:
        """`home` while it is within the load bound, else the first ring endpoint from `key` that is;
        a derived key (no session) has no home and is never recorded."""
        within = {e.endpoint_id: e for e in within_load_bound(
            endpoints, self._weights, self._config.load_factor)}
        if not within:
            return None
        if home is not None and home in within:
            return Decision(home, DecisionReason.AFFINITY_HIT, None)
        self._ring = self._ring.grown(endpoints)
        return self._moved(home, derived, self._ring.first(ring_hash(key), within))

    def select_fleet(self, request: RequestFacts, fleet: FleetView, levels: Levels,
                     tiers: TierMatches | None = None) -> Decision | None:
        """`select` over a fleet: the home's load and the ring walk's endpoints are looked up, not scanned."""
        key, home, derived = request.session_key, request.session_endpoint, False
        if key is None:
            key, home, derived = prefix_affinity_key(
                request.block_hashes, request.block_size, self._config.prefix_key_tokens), None, True
            if key is None:
                return self._fallback.select_fleet(request, fleet, levels)
        bound = fleet.bound(self._weights, self._config.load_factor)
        if bound is None:
            return None
        if home is not None and fleet.within(home, self._weights, bound):
            return Decision(home, DecisionReason.AFFINITY_HIT, None)
        if fleet.member_ids is not self._grown_from:
            self._ring, self._grown_from = self._ring.grown_ids(fleet.member_ids), fleet.member_ids
        within = WithinBound(fleet, self._weights, bound)
        return self._moved(home, derived, self._ring.first(ring_hash(key), within))

    def _moved(self, home: str | None, derived: bool, chosen: str | None) -> Decision | None:
        """The decision for the ring's pick `chosen` when the home (if any) was not within the bound."""
        if chosen is None:  # unreachable: `grown` put every candidate on the ring
            return None
        if derived:
            return Decision(chosen, DecisionReason.PREFIX_AFFINITY, None)
        if home is None:
            return Decision(chosen, DecisionReason.AFFINITY_NEW, None)
        return Decision(chosen, DecisionReason.AFFINITY_MOVED, home)
