"""A pool's usable endpoints kept up to date as their load changes (`FleetView`), so that a policy chooses among
1,000 endpoints without an `EndpointState` per endpoint per request: sums for the load bound, and each weighting's
endpoints ordered by load. The gateway feeds it (gateway/routing/live_pools.py); pure: no I/O, no clocks.
"""
from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from policies.base import Decision, RequestFacts, TokenWeights

# Tokens of load per bucket of an ordering: streamed tokens seldom move an endpoint out of its bucket.
_BUCKET_TOKENS = 64
# `FleetView.ascending` over a mask of at most this many endpoints sorts them rather than walking the buckets.
_FEW_MEMBERS = 64

# A prompt's leading runs as the prefix index gives them (cache.prefix_index.PrefixIndex.matched_levels): by
# increasing depth, (depth, bitmask of the endpoints whose device run is at least `depth`), masks shrinking.
Levels = Sequence[tuple[int, int]]

# One usable endpoint's load for `FleetView.put_many`: (endpoint id, its bit, prefill tokens, decode tokens in flight).
LoadUpdate = tuple[str, int, int, int]


class _Order:
    """The usable endpoints by one weighting's load (weighted tokens in flight), in buckets of `_BUCKET_TOKENS`:
    a load that changes within its bucket (a few tokens streamed) costs two dict writes, and the least loaded are
    in the first buckets. An endpoint's bucket is int(load) // _BUCKET_TOKENS (loads are never negative)."""
    __slots__ = ("bucket_of", "buckets", "decode_weight", "nonempty", "prefill_weight")

    def __init__(self, weights: TokenWeights) -> None:
        self.prefill_weight = weights.prefill_weight
        self.decode_weight = weights.decode_weight
        self.buckets: dict[int, dict[str, float]] = {}   # bucket -> {endpoint id: load}
        self.bucket_of: dict[str, int] = {}
        self.nonempty: list[int] = []                     # the buckets that hold an endpoint, ascending

    def put_many(self, updates: Sequence[LoadUpdate]) -> None:
        """Each endpoint's new load: in place while it stays in its bucket (the common case: a few tokens more or
        less), else moved. One loop with locals: the live view's upkeep runs it at every decision."""
        pw, dw, bucket_of, buckets = self.prefill_weight, self.decode_weight, self.bucket_of, self.buckets
        for endpoint_id, _, num_prefill, num_decode in updates:
            load = pw * num_prefill + dw * num_decode
            bucket = int(load) // _BUCKET_TOKENS
            if bucket_of.get(endpoint_id) == bucket:
                buckets[bucket][endpoint_id] = load
                continue
            self.discard(endpoint_id)
            bucket_of[endpoint_id] = bucket
            members = buckets.get(bucket)
            if members is None:
                members = buckets[bucket] = {}
                bisect.insort(self.nonempty, bucket)
            members[endpoint_id] = load

    def discard(self, endpoint_id: str) -> None:
        bucket = self.bucket_of.pop(endpoint_id, None)
        if bucket is None:
            return
        members = self.buckets[bucket]
        del members[endpoint_id]
        if not members:
            del self.buckets[bucket]
            del self.nonempty[bisect.bisect_left(self.nonempty, bucket)]

    def least(self, bit_of: dict[str, int], mask: int, bound: float, max_visits: float) -> list[str] | None:
        """The least loaded endpoints whose bits are in `mask` (-1: all) and whose load + 1 is within `bound`, all
        of them at that load ([] if none); None once more than `max_visits` endpoints were looked at."""
        visits = 0
        for bucket in self.nonempty:
            if bucket * _BUCKET_TOKENS + 1.0 > bound:
                break
            members = self.buckets[bucket]
            visits += len(members)
            if mask == -1:
                loads = [(load, endpoint_id) for endpoint_id, load in members.items() if load + 1.0 <= bound]
            else:
                loads = [(load, endpoint_id) for endpoint_id, load in members.items()
                         if bit_of[endpoint_id] & mask and load + 1.0 <= bound]
            if loads:
                least = min(loads)[0]
                return [endpoint_id for load, endpoint_id in loads if load == least]
            if visits > max_visits:
                return None
        return []


class FleetView:
    """One pool's endpoints: all of them (`member_ids`, a ring's members) and, of those, the usable ones (healthy,
    circuit closed) with their tokens in flight. `put`/`discard` keep it current, at O(1) while an endpoint's
    load stays in its bucket; reads visit the least loaded buckets."""

    def __init__(self, member_ids: Sequence[str]) -> None:
        self.member_ids = tuple(member_ids)               # every endpoint of the pool, usable or not
        self.loads: dict[str, tuple[int, int]] = {}       # usable endpoint -> (prefill, decode tokens in flight)
        self.bit_of: dict[str, int] = {}                  # usable endpoint -> its bit in the prefix index's masks
        self.id_of_bit: dict[int, str] = {}
        self.usable_mask = 0                              # the usable endpoints' bits
        self.sum_prefill = 0
        self.sum_decode = 0
        # the endpoints that hold KV tier blocks or read a shared store that does: a prompt's device run is not
        # all they may hold of it (the live view sets it at each use; a policy that scores cached tokens reads it)
        self.tiered_mask = 0
        self._orders: dict[tuple[float, float], _Order] = {}

    def put(self, endpoint_id: str, bit: int, num_prefill: int, num_decode: int) -> None:
        """`endpoint_id` is usable, with these tokens in flight."""
        self.put_many(((endpoint_id, bit, num_prefill, num_decode),))

    def put_many(self, updates: Sequence[LoadUpdate]) -> None:
        """`put` for each of `updates` (endpoints appear once), in one loop with locals: the upkeep of the endpoints
        changed since the last decision, at every decision."""
        loads, bit_of, id_of_bit = self.loads, self.bit_of, self.id_of_bit
        sum_prefill, sum_decode, usable_mask = self.sum_prefill, self.sum_decode, self.usable_mask
        for endpoint_id, bit, num_prefill, num_decode in updates:
            before = loads.get(endpoint_id)
            loads[endpoint_id] = (num_prefill, num_decode)
            if before is None:   # usable from now on
                bit_of[endpoint_id] = bit
                id_of_bit[bit] = endpoint_id
                usable_mask |= bit
                sum_prefill += num_prefill
                sum_decode += num_decode
            else:   # usable already: its load changed (a lease, tokens streamed, a report)
                sum_prefill += num_prefill - before[0]
                sum_decode += num_decode - before[1]
        self.sum_prefill, self.sum_decode, self.usable_mask = sum_prefill, sum_decode, usable_mask
        for order in self._orders.values():
            order.put_many(updates)

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

    def least(self, weights: TokenWeights, mask: int, bound: float) -> list[str]:
        """The least loaded usable endpoints whose bits are in `mask` (-1: all) with a load + 1 within `bound`,
        every one at that load ([] if none). A few holders, or holders all loaded (prefix-aware routing loads a
        prefix's holders), are looked up one by one rather than searched for from the least loaded up."""
        num_members = len(self.loads) if mask == -1 else mask.bit_count()
        found = self._order(weights).least(self.bit_of, mask, bound, 2 * num_members + 16)
        return self._least_of_members(weights, mask, bound) if found is None else found

    def _least_of_members(self, weights: TokenWeights, mask: int, bound: float) -> list[str]:
        pw, dw, loads, id_of_bit = weights.prefill_weight, weights.decode_weight, self.loads, self.id_of_bit
        found: list[str] = []
        least = math.inf
        while mask:
            low = mask & -mask
            mask ^= low
            endpoint_id = id_of_bit[low]
            num_prefill, num_decode = loads[endpoint_id]
            load = pw * num_prefill + dw * num_decode
            if load + 1.0 > bound or load > least:
                continue
            if load < least:
                least, found = load, []
            found.append(endpoint_id)
        return found

    def ascending(self, weights: TokenWeights, mask: int) -> Iterator[tuple[float, list[str]]]:
        """The usable endpoints whose bits are in `mask`, a load bucket at a time from the least loaded: (the least
        load the bucket can hold, its members in `mask`). For a search whose bound tightens as it goes."""
        if mask.bit_count() <= _FEW_MEMBERS:   # a few (often loaded) holders: sorted, not searched for
            pw, dw, loads, id_of_bit = weights.prefill_weight, weights.decode_weight, self.loads, self.id_of_bit
            few = []
            while mask:
                low = mask & -mask
                mask ^= low
                num_prefill, num_decode = loads[id_of_bit[low]]
                few.append((pw * num_prefill + dw * num_decode, id_of_bit[low]))
            for load, endpoint_id in sorted(few):
                yield load, [endpoint_id]
            return
        order, bit_of = self._order(weights), self.bit_of
        for bucket in order.nonempty:
            members = [endpoint_id for endpoint_id in order.buckets[bucket] if bit_of[endpoint_id] & mask]
            if members:
                yield float(bucket * _BUCKET_TOKENS), members

    def pick_least(self, weights: TokenWeights, rng: random.Random) -> str | None:
        """`policies.base.pick_least` by weighted tokens: the least loaded usable endpoint, ties uniformly at random."""
        least = self._order(weights).least(self.bit_of, -1, math.inf, math.inf)
        if not least:
            return None
        return least[0] if len(least) == 1 else rng.choice(least)

    def _order(self, weights: TokenWeights) -> _Order:
        key = (weights.prefill_weight, weights.decode_weight)
        order = self._orders.get(key)
        if order is None:  # a weighting seen first: sorted once, then kept
            order = self._orders[key] = _Order(weights)
            order.put_many([(endpoint_id, 0, num_prefill, num_decode)
                            for endpoint_id, (num_prefill, num_decode) in self.loads.items()])
        return order


class WithinBound:
    """The usable endpoints within a load bound, as a container a hash ring's walk can test."""
    __slots__ = ("_bound", "_fleet", "_weights")

    def __init__(self, fleet: FleetView, weights: TokenWeights, bound: float) -> None:
        self._fleet, self._weights, self._bound = fleet, weights, bound

    def __contains__(self, endpoint_id: object) -> bool:
        return isinstance(endpoint_id, str) and self._fleet.within(endpoint_id, self._weights, self._bound)


class TierMatches(Protocol):
    """A prompt's KV tier blocks where the fleet's tiered endpoints (`FleetView.tiered_mask`) read them back from,
    for one decision (cache.tier_runs.PromptTiers)."""
    own_mask: int   # endpoints holding tier blocks of their own (RAM, disk, own store blocks): found by `own_levels`
    restore_fractions: Callable[[str], tuple[float | None, float | None, float | None]]   # measured, per endpoint

    @property
    def stores(self) -> Sequence[tuple[int, Sequence[int]]]:
        """Each shared store that holds blocks: (its readers' bits less `own_mask`, the prompt's run in it from each
        block on, one entry past the last)."""
        ...

    @property
    def own_levels(self) -> Levels:
        """Of the `own_mask` endpoints, the prompt's leading runs in what each can read (device, own tiers, the store
        it reads), as `Levels`: a bound on what each holds."""
        ...

    def matched(self, endpoint_id: str, num_device: int) -> tuple[int, int, int, int]:
        """The endpoint's leading run by medium (device, cpu, disk, store), its device run known."""
        ...


@runtime_checkable
class FleetPolicy(Protocol):
    def select_fleet(self, request: RequestFacts, fleet: FleetView, levels: Levels,
                     tiers: TierMatches | None = None) -> Decision | None:
        """`select`'s decision over `fleet`'s usable endpoints (each one's device run from `levels`, what its KV tiers
        hold from `tiers`), found without visiting every endpoint; None: this request needs `select` (a case the
        fast path does not cover)."""
        ...


def run_of(bit: int, levels: Levels) -> int:
    """The device run of the endpoint with `bit`: the depth of the deepest level holding it."""
    run = 0
    for depth, mask in levels:
        if not mask & bit:
            break
        run = depth
    return run
