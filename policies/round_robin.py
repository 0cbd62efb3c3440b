"""Round robin over the healthy candidates: a rotating counter, unhealthy endpoints skipped."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import Decision, DecisionReason, EndpointState, RequestFacts, config_from_options


@dataclass(frozen=True, slots=True)
class RoundRobinConfig:
    pass


class RoundRobinPolicy:
    def __init__(self, config: RoundRobinConfig | None = None) -> None:
        self._next = 0  # rotation counter; taken modulo the number of healthy candidates

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RoundRobinPolicy:
        return cls(config_from_options(RoundRobinConfig, options))

    def select(self, request: RequestFacts, endpoints: Sequence[EndpointState]) -> Decision | None:
        healthy = [e for e in endpoints if e.healthy]
        if not healthy:
            return None
        chosen = healthy[self._next % len(healthy)]
        self._next += 1
        return Decision(chosen.endpoint_id, DecisionReason.BALANCED, None)
