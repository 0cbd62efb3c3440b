"""Least tokens in flight (prefill + decode, optionally weighted) among the healthy candidates,
preferring endpoints with KV headroom; ties broken at random."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
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
    pick_least,
)
from policies.fleet_view import FleetView, Levels, TierMatches


@dataclass(frozen=True, slots=True)
class LeastTokensConfig:
    prefill_weight: float = 1.0        # cost of one prompt token still to prefill
    decode_weight: float = 1.0         # cost of one output token still to decode
    min_kv_free_fraction: float = 0.0  # endpoints reporting less free KV are used only if all do
    seed: int | None = None            # seeds the tie-breaking RNG (tests); None: nondeterministic

    def __post_init__(self) -> None:
        TokenWeights(self.prefill_weight, self.decode_weight)  # validates the weights
        check_number("min_kv_free_fraction", self.min_kv_free_fraction, minimum=0.0)
        check_seed(self.seed)


class LeastTokensPolicy:
    def __init__(self, config: LeastTokensConfig | None = None) -> None:
        config = config or LeastTokensConfig()
        self._weights = TokenWeights(config.prefill_weight, config.decode_weight)
        self._min_kv_free = config.min_kv_free_fraction
        self._rng = random.Random(config.seed)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> LeastTokensPolicy:
        return cls(config_from_options(LeastTokensConfig, options))

    def select(self, request: RequestFacts, endpoints: Sequence[EndpointState]) -> Decision | None:
        candidates = endpoints
        if self._min_kv_free > 0.0:
            roomy = [e for e in endpoints if e.healthy and (
                e.kv_free_fraction is None or e.kv_free_fraction >= self._min_kv_free)]
            candidates = roomy or endpoints
        chosen = pick_least(candidates, self._weights.cost, self._rng)
        return None if chosen is None else Decision(chosen.endpoint_id, DecisionReason.BALANCED, None)

    def select_fleet(self, request: RequestFacts, fleet: FleetView, levels: Levels,
                     tiers: TierMatches | None = None) -> Decision | None:
        """`select` over a fleet: its least loaded usable endpoint, from the fleet's ordering by load."""
        if self._min_kv_free > 0.0:
            return None
        chosen = fleet.pick_least(self._weights, self._rng)
        return None if chosen is None else Decision(chosen, DecisionReason.BALANCED, None)
