"""Cache-aware routing (after sgl-router's cache_aware policy): among the endpoints within a load
bound, maximize prompt tokens already cached there minus `alpha` x tokens in flight. A token read back
from a KV tier rather than found on the device counts for what reading it back saves of computing it:
1 - the restore fraction its worker measured for that medium (`measured_tier_weights`), or, until the worker
reports one, the medium's fixed weight (`cpu_weight`, `disk_weight`, `store_weight`, at most 1: reading it
back costs time a device hit does not). When no candidate holds any
of the prompt's leading blocks: with `prefix_key_tokens`, the ring home (within the bound) of a key from
the prompt's prefix, so gateway processes whose indexes differ still agree where a new prefix goes;
otherwise least_tokens.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
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
    pick_least,
    prefix_affinity_key,
    within_load_bound,
)
from policies.fleet_view import FleetView, Levels, TierMatches, WithinBound, run_of
from policies.least_tokens import LeastTokensConfig, LeastTokensPolicy
from policies.session_affinity import HashRing, ring_hash

# In `select_fleet`, a level of the prompt's leading runs held by at most this many usable endpoints is visited
# member by member; the endpoints outside it are visited least loaded first, until none can score better.
_NUM_LISTED = 8


@dataclass(frozen=True, slots=True)
class PrefixAwareConfig:
    alpha: float = 0.5            # one in-flight token's weight against one cached prompt token (best in routing_sim)
    load_factor: float = 1.5      # only endpoints with load <= load_factor x mean load compete
    prefill_weight: float = 1.0   # load = weighted tokens in flight (also the fallback's weights)
    decode_weight: float = 1.0
    seed: int | None = None       # seeds the tie-breaking RNG (tests)
    prefix_key_tokens: int = 0    # cold prompt: the ring home of its first N tokens' key (0: least_tokens)
    num_virtual_nodes: int = 100  # ring points per endpoint, for prefix_key_tokens
    # A cached token's worth when it is read back from that KV tier, against 1.0 on the device: with
    # `measured_tier_weights`, 1 - the restore fraction the endpoint's worker reports for the medium.
    measured_tier_weights: bool = True
    # The worth where no measurement is reported (another engine, or no restore yet), or with
    # `measured_tier_weights` off: a guess at the share of its prefill that a read from host RAM, a local
    # disk or the shared store saves (CPU workers measured restore fractions of 0.003-0.04 for RAM and disk,
    # up to 0.14 for a Mooncake store: docs/benchmarks.md).
    cpu_weight: float = 0.8
    disk_weight: float = 0.5
    store_weight: float = 0.3

    def __post_init__(self) -> None:
        check_number("alpha", self.alpha, minimum=0.0)
        if not isinstance(self.measured_tier_weights, bool):
            raise ValueError(f"policy option 'measured_tier_weights' must be true or false, "
                             f"got {self.measured_tier_weights!r}")
        for name in ("cpu_weight", "disk_weight", "store_weight"):
            check_number(name, getattr(self, name), minimum=0.0)
            if getattr(self, name) > 1.0:  # a tier hit must never outrank a device hit of the same length
                raise ValueError(f"policy option {name!r} must be <= 1, got {getattr(self, name)!r}")
        for name in ("prefix_key_tokens", "num_virtual_nodes"):
            check_number(name, getattr(self, name), minimum=0 if name == "prefix_key_tokens" else 1)
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"policy option {name!r} must be an integer")
        check_number("load_factor", self.load_factor, minimum=1.0)
        TokenWeights(self.prefill_weight, self.decode_weight)
        check_seed(self.seed)


class PrefixAwarePolicy:
    def __init__(self, config: PrefixAwareConfig | None = None) -> None:
        config = config or PrefixAwareConfig()
        self._config = config
        self._weights = TokenWeights(config.prefill_weight, config.decode_weight)
        self._rng = random.Random(config.seed)
        # score = cached prompt tokens - alpha x weighted tokens in flight, terms precomputed
        self._alpha_prefill = config.alpha * config.prefill_weight
        self._alpha_decode = config.alpha * config.decode_weight
        self._tier_weights = (config.cpu_weight, config.disk_weight, config.store_weight)
        self._fallback = LeastTokensPolicy(LeastTokensConfig(
            prefill_weight=config.prefill_weight, decode_weight=config.decode_weight,
            seed=None if config.seed is None else config.seed + 1))
        self._ring = HashRing((), config.num_virtual_nodes)
        self._grown_from: tuple[str, ...] | None = None   # the fleet members the ring last grew by

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> PrefixAwarePolicy:
        return cls(config_from_options(PrefixAwareConfig, options))

    def select(self, request: RequestFacts, endpoints: Sequence[EndpointState]) -> Decision | None:
        within = within_load_bound(endpoints, self._weights, self._config.load_factor)
        best = max((e.num_matched_blocks + sum(e.num_tier_matched_blocks) for e in within), default=0)
        if best == 0 or best < self._num_key_blocks(request):
            return self._cold(request, endpoints, within)
        # The block size comes with the request's hashes, so it can never disagree with them.
        block_size = request.block_size
        chosen = pick_least(within, lambda e: self._negative_score(e, block_size), self._rng)
        if chosen is None:  # unreachable: `within` holds a healthy endpoint
            return None
        hit = chosen.num_matched_blocks > 0 or any(chosen.num_tier_matched_blocks)
        reason = DecisionReason.PREFIX_HIT if hit else DecisionReason.BALANCED
        return Decision(chosen.endpoint_id, reason, None)

    def _num_key_blocks(self, request: RequestFacts) -> int:
        """Blocks behind the prefix key (0: no key): a prompt none of whose candidates holds that many
        is routed by its key, since no index this process has knows where its own prefix went."""
        if not self._config.prefix_key_tokens:
            return 0
        return min(len(request.block_hashes), max(1, self._config.prefix_key_tokens // request.block_size))

    def _cold(self, request: RequestFacts, endpoints: Sequence[EndpointState],
              within: Sequence[EndpointState]) -> Decision | None:
        key = prefix_affinity_key(request.block_hashes, request.block_size, self._config.prefix_key_tokens)
        if key is None or not within:
            return self._fallback.select(request, endpoints)
        self._ring = self._ring.grown(endpoints)
        chosen = self._ring.first(ring_hash(key), {e.endpoint_id: e for e in within})
        if chosen is None:  # unreachable: `grown` put every candidate on the ring
            return None
        return Decision(chosen, DecisionReason.PREFIX_AFFINITY, None)

    def _weights_at(self, fractions: tuple[float | None, float | None, float | None]) -> tuple[float, float, float]:
        """(cpu, disk, store) worth of a block read back at an endpoint whose worker measured these restore
        fractions: measured where it says, else fixed."""
        if not self._config.measured_tier_weights or fractions == (None, None, None):
            return self._tier_weights
        cpu, disk, store = (fixed if f is None else min(1.0, max(0.0, 1.0 - f))
                            for f, fixed in zip(fractions, self._tier_weights, strict=True))
        return (cpu, disk, store)

    def _negative_score(self, endpoint: EndpointState, block_size: int) -> float:
        return self._score(endpoint.num_prefill_tokens, endpoint.num_decode_tokens, endpoint.num_matched_blocks,
                           endpoint.num_tier_matched_blocks, endpoint.tier_restore_fractions, block_size)

    def _score(self, num_prefill: int, num_decode: int, num_device: int, num_tier: tuple[int, int, int],
               fractions: tuple[float | None, float | None, float | None], block_size: int) -> float:
        """The negative score of an endpoint with these tokens in flight and this leading run: the same
        arithmetic whether `select` or `select_fleet` asks (ties must compare equal)."""
        cached_blocks: float = num_device
        num_cpu, num_disk, num_store = num_tier
        if num_cpu or num_disk or num_store:  # most endpoints hold none of it in a tier: skip the products
            cpu_weight, disk_weight, store_weight = self._weights_at(fractions)
            cached_blocks += cpu_weight * num_cpu + disk_weight * num_disk + store_weight * num_store
        return self._alpha_prefill * num_prefill + self._alpha_decode * num_decode - cached_blocks * block_size

    def select_fleet(self, request: RequestFacts, fleet: FleetView, levels: Levels,
                     tiers: TierMatches | None = None) -> Decision | None:
        """`select` over a fleet, without an `EndpointState` per endpoint: the argmin of the same score over the
        usable endpoints within the bound, ties at random; a cold prompt (`prefix_key_tokens`) to its key's ring home
        within the bound. Not covered (None): alpha 0, usable endpoints holding KV tier blocks (`fleet.tiered_mask`)
        without `tiers`."""
        if not self._config.alpha:
            return None
        tiered = fleet.tiered_mask & fleet.usable_mask
        if tiered and tiers is None:
            return None
        bound = fleet.bound(self._weights, self._config.load_factor)
        if bound is None:
            return None
        usable = fleet.usable_mask
        runs = [(depth, mask & usable) for depth, mask in levels]
        while runs and not runs[-1][1]:   # nested masks: the empty ones are the deepest
            runs.pop()
        if self._config.prefix_key_tokens and not _Holds(fleet, self._weights, runs, bound).any(
                max(1, self._num_key_blocks(request)), tiers if tiered else None):
            return self._cold_fleet(request, fleet, levels, bound)
        search = _Search(self, request.block_size, fleet, runs, bound, tiers if tiered else None)
        tied = search.least_scored()
        if not tied:
            return None
        endpoint_id, held = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        return Decision(endpoint_id, DecisionReason.PREFIX_HIT if held else DecisionReason.BALANCED, None)

    def _cold_fleet(self, request: RequestFacts, fleet: FleetView, levels: Levels, bound: float) -> Decision | None:
        """`_cold` over a fleet: the key's ring home among the usable endpoints within the bound (the ring holds
        every member; one that is not usable is passed by, as `_cold`'s ring passes the ones it was not given)."""
        key = prefix_affinity_key(request.block_hashes, request.block_size, self._config.prefix_key_tokens)
        if key is None:
            return self._fallback.select_fleet(request, fleet, levels)
        if fleet.member_ids is not self._grown_from:
            self._ring, self._grown_from = self._ring.grown_ids(fleet.member_ids), fleet.member_ids
        chosen = self._ring.first(ring_hash(key), WithinBound(fleet, self._weights, bound))
        return None if chosen is None else Decision(chosen, DecisionReason.PREFIX_AFFINITY, None)


def _store_blocks(store_runs: Sequence[int], endpoint_id: str, run: int) -> tuple[int, int, int]:
    """What a store's reader holding no tier blocks of its own reads past its device run: the store's run there."""
    return (0, 0, store_runs[run])


_NO_FRACTIONS: tuple[float | None, float | None, float | None] = (None, None, None)


class _Search:
    """One `select_fleet` decision's search for the least negative score. The best score is the least, over the
    levels (depth d, holders M; and depth 0, every endpoint), of the least loaded holder's score at d: an endpoint's
    own level gives its score, a shallower one only a worse one. Levels of few holders are scored member by member;
    in a level of many, the least loaded holder is near the front. With KV tiers, each endpoint visited is scored
    exactly: a shared store's readers are searched by load at each level, bounded by the most a store block can be
    worth (1, or the fixed weight); the endpoints holding tier blocks of their own, at each level of what they
    hold anywhere (`TierMatches.own_levels`), bounded by a block's most worth, 1."""

    def __init__(self, policy: PrefixAwarePolicy, block_size: int, fleet: FleetView, runs: Levels, bound: float,
                 tiers: TierMatches | None) -> None:
        self.policy, self.block_size, self.fleet, self.runs, self.bound, self.tiers = (
            policy, block_size, fleet, runs, bound, tiers)
        self.tiered = 0 if tiers is None else fleet.tiered_mask & fleet.usable_mask
        self.scored: dict[str, tuple[float, int]] = {}   # endpoint -> (least score seen, blocks it holds there)
        self.best = math.inf

    def least_scored(self) -> list[tuple[str, int]]:
        """(endpoint id, blocks of the prompt it holds) of every usable endpoint within the bound of least score."""
        runs, fleet = self.runs, self.fleet
        j = next((k for k, (_, mask) in enumerate(runs) if mask.bit_count() <= _NUM_LISTED), len(runs))
        self._score_each(runs[j][1] if j < len(runs) else 0)
        # Depth 0 (every endpoint) first, then the deepest level first: each best score so far caps the load
        # worth looking for at the next level, load <= (best + depth x block_size) / alpha.
        levels = [(0, fleet.usable_mask), *reversed(runs[:j])]
        if j and runs[0][1] == fleet.usable_mask:   # every endpoint holds the first blocks
            levels[0] = runs[0]
            levels.pop()
        if self.tiers is not None:
            self._search_own(self.tiers)
            self._search_stores(levels, self.tiers)
        self._search_levels(levels)
        if not self.scored:
            return []
        best = min(score for score, _ in self.scored.values())
        return [(endpoint_id, held) for endpoint_id, (score, held) in self.scored.items() if score == best]

    def _record(self, endpoint_id: str, score: float, held: int) -> None:
        if endpoint_id not in self.scored or score < self.scored[endpoint_id][0]:
            self.scored[endpoint_id] = (score, held)
        self.best = min(self.best, score)

    def _cap(self, credit: float) -> float:
        """The most load + 1 an endpoint credited with `credit` blocks may carry and still score the best so far."""
        if self.best == math.inf:
            return self.bound
        alpha = self.policy._config.alpha
        return min(self.bound, ((self.best + credit * self.block_size) / alpha + 1.0) * (1 + 1e-9))

    def _score_each(self, mask: int) -> None:
        """Score each endpoint of `mask` within the bound exactly, at its own run and through its tiers."""
        fleet, weights, loads, tiered, scored = self.fleet, self.policy._weights, self.fleet.loads, self.tiered, (
            self.scored)
        ap, ad, block_size = self.policy._alpha_prefill, self.policy._alpha_decode, self.block_size
        while mask:
            low = mask & -mask
            mask ^= low
            endpoint_id = fleet.id_of_bit[low]
            num_prefill, num_decode = loads[endpoint_id]
            if weights.prefill_weight * num_prefill + weights.decode_weight * num_decode + 1.0 > self.bound:
                continue
            run = run_of(low, self.runs)
            if not low & tiered or self.tiers is None:   # the common case, inline: the same arithmetic as `_score`
                scored[endpoint_id] = (score := ap * num_prefill + ad * num_decode - run * block_size, run)
                self.best = min(self.best, score)
                continue
            store_runs = next((r for readers, r in self.tiers.stores if readers & low), None)
            if store_runs is not None:   # a store's reader holding no blocks of its own: its run is the store's
                self._score_at(endpoint_id, num_prefill, num_decode, run, (0, 0, store_runs[run]))
            else:
                self._score_at(endpoint_id, num_prefill, num_decode, run, self.tiers.matched(endpoint_id, run)[1:])

    def _score_at(self, endpoint_id: str, num_prefill: int, num_decode: int, run: int,
                  tier_blocks: tuple[int, int, int]) -> None:
        fractions = _NO_FRACTIONS
        if any(tier_blocks) and self.tiers is not None:
            fractions = self.tiers.restore_fractions(endpoint_id)
        score = self.policy._score(num_prefill, num_decode, run, tier_blocks, fractions, self.block_size)
        self._record(endpoint_id, score, run + sum(tier_blocks))

    def _search_own(self, tiers: TierMatches) -> None:
        """The endpoints holding tier blocks of their own, deepest level of what they hold first, from the least
        loaded up while one could still score the best (a block is worth at most 1)."""
        own = tiers.own_mask & self.tiered
        if not own:
            return
        for depth, level_mask in [*reversed(tiers.own_levels), (0, own)]:
            self._visit(level_mask & own, depth, lambda endpoint_id, run: tiers.matched(endpoint_id, run)[1:])

    def _search_stores(self, levels: Levels, tiers: TierMatches) -> None:
        """Each store's readers, level by level, from the least loaded up while one could still score the best."""
        config = self.policy._config
        most = 1.0 if config.measured_tier_weights else config.store_weight   # a store block's worth, at most
        for readers, store_runs in tiers.stores:
            group = readers & self.tiered
            for depth, level_mask in levels:
                if members := group & level_mask:
                    self._visit(members, depth + most * store_runs[depth],
                                partial(_store_blocks, store_runs))

    def _visit(self, members: int, credit: float, tier_blocks: Callable[[str, int], tuple[int, int, int]]) -> None:
        """Score `members` within the bound exactly (`tier_blocks`: what its tiers hold past its device run), from
        the least loaded up while one credited with `credit` blocks could still score the best."""
        fleet, loads = self.fleet, self.fleet.loads
        pw, dw = self.policy._weights.prefill_weight, self.policy._weights.decode_weight
        for least_load, endpoint_ids in fleet.ascending(self.policy._weights, members):
            if least_load + 1.0 > self._cap(credit):
                break
            for endpoint_id in endpoint_ids:
                num_prefill, num_decode = loads[endpoint_id]
                if pw * num_prefill + dw * num_decode + 1.0 <= self.bound:
                    run = run_of(fleet.bit_of[endpoint_id], self.runs)
                    self._score_at(endpoint_id, num_prefill, num_decode, run, tier_blocks(endpoint_id, run))

    def _search_levels(self, levels: Levels) -> None:
        """The endpoints holding no tier block: at each level the least loaded within the cap, scored at its depth."""
        fleet, loads, weights = self.fleet, self.fleet.loads, self.policy._weights
        ap, ad = self.policy._alpha_prefill, self.policy._alpha_decode
        plain = ~self.tiered
        for depth, level_mask in levels:
            whole = level_mask == fleet.usable_mask and not self.tiered   # every usable endpoint: no bit to test
            mask = -1 if whole else level_mask & plain
            if not mask:
                continue
            for endpoint_id in fleet.least(weights, mask, self._cap(depth)):
                num_prefill, num_decode = loads[endpoint_id]
                self._record(endpoint_id, ap * num_prefill + ad * num_decode - depth * self.block_size, depth)


class _Holds:
    """`select`'s test of a prompt that is not cold, over a fleet: some usable endpoint within the bound holds at least
    `need` of its leading blocks, on its device or read back through its KV tiers (counted exactly, as listing
    counts them)."""

    def __init__(self, fleet: FleetView, weights: TokenWeights, runs: Levels, bound: float) -> None:
        self.fleet, self.weights, self.runs, self.bound = fleet, weights, runs, bound

    def any(self, need: int, tiers: TierMatches | None) -> bool:
        fleet, weights, runs, bound = self.fleet, self.weights, self.runs, self.bound
        if any(depth >= need and fleet.least(weights, mask, bound) for depth, mask in runs):
            return True
        if tiers is None:
            return False
        tiered = fleet.tiered_mask & fleet.usable_mask
        own = tiers.own_mask & tiered
        deep = next((mask & own for depth, mask in tiers.own_levels if depth >= need), 0)   # an upper bound on each
        if deep and any(run + sum(tiers.matched(endpoint_id, run)[1:]) >= need
                        for endpoint_id, run in self._within(deep)):
            return True
        # a store's reader whose device run is d holds d + the store's run from block d: by the readers' exact runs
        exact = [(0, fleet.usable_mask & ~runs[0][1] if runs else fleet.usable_mask)]
        exact += [(depth, mask & ~(runs[i + 1][1] if i + 1 < len(runs) else 0)) for i, (depth, mask) in enumerate(runs)]
        return any(depth + store_runs[depth] >= need and fleet.least(weights, readers & tiered & mask, bound)
                   for readers, store_runs in tiers.stores for depth, mask in exact if readers & tiered & mask)

    def _within(self, mask: int) -> Iterator[tuple[str, int]]:
        """(endpoint id, device run) of each member of `mask` within the bound, the least loaded first."""
        fleet, pw, dw = self.fleet, self.weights.prefill_weight, self.weights.decode_weight
        for least_load, endpoint_ids in fleet.ascending(self.weights, mask):
            if least_load + 1.0 > self.bound:
                return
            for endpoint_id in endpoint_ids:
                num_prefill, num_decode = fleet.loads[endpoint_id]
                if pw * num_prefill + dw * num_decode + 1.0 <= self.bound:
                    yield endpoint_id, run_of(fleet.bit_of[endpoint_id], self.runs)
