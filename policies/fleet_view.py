"""A pool's usable endpoints kept up to date as their load changes (`FleetView`), so that a policy chooses among
1,000 endpoints without an `EndpointState` per endpoint per request: sums for the load bound, and each weighting's
endpoints ordered by load. The gateway feeds it (gateway/routing/live_pools.py); pure: no I/O, no clocks.
"""
from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from policies.base import Decision, RequestFacts, TokenWeights

# Sorts after every endpoint id: the end of a run of equal loads in an ordering.
_LAST_ID = "\U0010ffff"

# A prompt's leading runs as the prefix index gives them (cache.prefix_index.PrefixIndex.matched_levels): by
# increasing depth, (depth, bitmask of the endpoints whose device run is at least `depth`), masks shrinking.
Levels = Sequence[tuple[int, int]]


class _Order:
    """The usable endpoints sorted by one weighting's load (weighted tokens in flight)."""
    __slots__ = ("keys", "load_of", "weights")

    def __init__(self, weights: TokenWeights) -> None:
        self.weights = weights
        self.keys: list[tuple[float, str]] = []   # (load, endpoint id), ascending
        self.load_of: dict[str, float] = {}

    def put(self, endpoint_id: str, num_prefill: int, num_decode: int) -> None:
        self.discard(endpoint_id)
        load = self.weights.prefill_weight * num_prefill + self.weights.decode_weight * num_decode
        self.load_of[endpoint_id] = load
        bisect.insort(self.keys, (load, endpoint_id))

    def discard(self, endpoint_id: str) -> None:
        load = self.load_of.pop(endpoint_id, None)
        if load is not None:
            del self.keys[bisect.bisect_left(self.keys, (load, endpoint_id))]


class FleetView:
    """One pool's endpoints: all of them (`member_ids`, a ring's members) and, of those, the usable ones (healthy,
    circuit closed) with their tokens in flight. `put`/`discard` keep it current; reads cost O(log n)."""

    def __init__(self, member_ids: Sequence[str]) -> None:
        self.member_ids = tuple(member_ids)               # every endpoint of the pool, usable or not
        self.loads: dict[str, tuple[int, int]] = {}       # usable endpoint -> (prefill, decode tokens in flight)
        self.bit_of: dict[str, int] = {}                  # usable endpoint -> its bit in the prefix index's masks
        self.id_of_bit: dict[int, str] = {}
        self.usable_mask = 0                              # the usable endpoints' bits
        self.sum_prefill = 0
        self.sum_decode = 0
        self._orders: dict[tuple[float, float], _Order] = {}

    def put(self, endpoint_id: str, bit: int, num_prefill: int, num_decode: int) -> None:
        """`endpoint_id` is usable, with these tokens in flight."""
        self.discard(endpoint_id)
        self.loads[endpoint_id] = (num_prefill, num_decode)
        self.bit_of[endpoint_id] = bit
        self.id_of_bit[bit] = endpoint_id
        self.usable_mask |= bit
        self.sum_prefill += num_prefill
        self.sum_decode += num_decode
        for order in self._orders.values():
            order.put(endpoint_id, num_prefill, num_decode)

    def discard(self, endpoint_id: str) -> None:
        """`endpoint_id` is not usable (unhealthy, circuit not closed, gone)."""
        loads = self.loads.pop(endpoint_id, None)
        if loads is None:
            return
        bit = self.bit_of.pop(endpoint_id)
        del self.id_of_bit[bit]
        self.usable_mask &= ~bit
        self.sum_prefill -= loads[0]
        self.sum_decode -= loads[1]
        for order in self._orders.values():
            order.discard(endpoint_id)

    def bound(self, weights: TokenWeights, load_factor: float) -> float | None:
        """`policies.base.within_load_bound`'s bound on a usable endpoint's load + 1; None: none is usable."""
        num = len(self.loads)
        if not num:
            return None
        total = weights.prefill_weight * self.sum_prefill + weights.decode_weight * self.sum_decode + num
        return load_factor * total / num * (1.0 + 1e-9)

    def within(self, endpoint_id: str, weights: TokenWeights, bound: float) -> bool:
        """Usable, with a load + 1 of at most `bound`."""
        loads = self.loads.get(endpoint_id)
        return loads is not None and (
            weights.prefill_weight * loads[0] + weights.decode_weight * loads[1] + 1.0 <= bound)

    def ascending(self, weights: TokenWeights) -> Iterator[tuple[float, str]]:
        """(load, endpoint id) of the usable endpoints, least loaded first."""
        return iter(self._order(weights).keys)

    def pick_least(self, weights: TokenWeights, rng: random.Random) -> str | None:
        """`policies.base.pick_least` by weighted tokens: the least loaded usable endpoint, ties uniformly at random."""
        keys = self._order(weights).keys
        if not keys:
            return None
        end = bisect.bisect_right(keys, (keys[0][0], _LAST_ID))
        return keys[0 if end == 1 else rng.randrange(end)][1]

    def _order(self, weights: TokenWeights) -> _Order:
        key = (weights.prefill_weight, weights.decode_weight)
        order = self._orders.get(key)
        if order is None:  # a weighting seen first: sorted once, then kept
            order = self._orders[key] = _Order(weights)
            for endpoint_id, (num_prefill, num_decode) in self.loads.items():
                order.put(endpoint_id, num_prefill, num_decode)
        return order


class WithinBound:
    """The usable endpoints within a load bound, as a container a hash ring's walk can test."""
    __slots__ = ("_bound", "_fleet", "_weights")

    def __init__(self, fleet: FleetView, weights: TokenWeights, bound: float) -> None:
        self._fleet, self._weights, self._bound = fleet, weights, bound

    def __contains__(self, endpoint_id: object) -> bool:
        return isinstance(endpoint_id, str) and self._fleet.within(endpoint_id, self._weights, self._bound)


@runtime_checkable
class FleetPolicy(Protocol):
    def select_fleet(self, request: RequestFacts, fleet: FleetView, levels: Levels) -> Decision | None:
        """`select`'s decision over `fleet`'s usable endpoints (each one's device run from `levels`), found without
        visiting every endpoint; None: this request needs `select` (a case the fast path does not cover)."""
        ...


def run_of(bit: int, levels: Levels) -> int:
    """The device run of the endpoint with `bit`: the depth of the deepest level holding it."""
    run = 0
    for depth, mask in levels:
        if not mask & bit:
            break
        run = depth
    return run
