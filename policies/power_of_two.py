"""Power of two choices: sample two distinct healthy candidates, keep the one with fewer
(weighted) tokens in flight. Cheap, and avoids herding onto one stale least-loaded endpoint."""
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
    check_seed,
    config_from_options,
)


@dataclass(frozen=True, slots=True)
class PowerOfTwoConfig:
    prefill_weight: float = 1.0  # cost of one prompt token still to prefill
    decode_weight: float = 1.0   # cost of one output token still to decode
    seed: int | None = None      # seeds the sampling RNG (tests); None: nondeterministic

    def __post_init__(self) -> None:
        TokenWeights(self.prefill_weight, self.decode_weight)
        check_seed(self.seed)


class PowerOfTwoPolicy:
    def __init__(self, config: PowerOfTwoConfig | None = None) -> None:
        config = config or PowerOfTwoConfig()
        self._weights = TokenWeights(config.prefill_weight, config.decode_weight)
        self._rng = random.Random(config.seed)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> PowerOfTwoPolicy:
        return cls(config_from_options(PowerOfTwoConfig, options))

    def select(self, request: RequestFacts, endpoints: Sequence[EndpointState]) -> Decision | None:
        healthy = [e for e in endpoints if e.healthy]
        if not healthy:
            return None
        if len(healthy) == 1:
            return Decision(healthy[0].endpoint_id, DecisionReason.BALANCED, None)
        i = self._rng.randrange(len(healthy))
        j = self._rng.randrange(len(healthy) - 1)
        j += j >= i  # a second index distinct from the first, uniformly
        a, b = healthy[i], healthy[j]  # already a random order, so a tie keeps a random one
        chosen = b if self._weights.cost(b) < self._weights.cost(a) else a
        return Decision(chosen.endpoint_id, DecisionReason.BALANCED, None)
