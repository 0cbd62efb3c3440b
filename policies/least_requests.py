"""Least requests in flight among the healthy candidates; ties broken at random."""
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
    check_seed,
    config_from_options,
    pick_least,
)


@dataclass(frozen=True, slots=True)
class LeastRequestsConfig:
    seed: int | None = None  # seeds the tie-breaking RNG (tests); None: nondeterministic

    def __post_init__(self) -> None:
        check_seed(self.seed)


def _num_requests(endpoint: EndpointState) -> float:
    return endpoint.num_requests


class LeastRequestsPolicy:
    def __init__(self, config: LeastRequestsConfig | None = None) -> None:
        config = config or LeastRequestsConfig()
        self._rng = random.Random(config.seed)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> LeastRequestsPolicy:
        return cls(config_from_options(LeastRequestsConfig, options))

    def select(self, request: RequestFacts, endpoints: Sequence[EndpointState]) -> Decision | None:
        chosen = pick_least(endpoints, _num_requests, self._rng)
        return None if chosen is None else Decision(chosen.endpoint_id, DecisionReason.BALANCED, None)
