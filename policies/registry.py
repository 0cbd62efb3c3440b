"""Policy names (as written in the config) and the one table from name to factory.
Adding a policy = one file in policies/ and one line in `_FACTORIES`."""
from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from policies.base import Policy
from policies.least_requests import LeastRequestsPolicy
from policies.least_tokens import LeastTokensPolicy
from policies.power_of_two import PowerOfTwoPolicy
from policies.prefix_aware import PrefixAwarePolicy
from policies.round_robin import RoundRobinPolicy
from policies.session_affinity import SessionAffinityPolicy


class PolicyName(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_REQUESTS = "least_requests"
    LEAST_TOKENS = "least_tokens"
    POWER_OF_TWO = "power_of_two"
    SESSION_AFFINITY = "session_affinity"
    PREFIX_AWARE = "prefix_aware"


PolicyFactory = Callable[[Mapping[str, Any]], Policy]

_FACTORIES: Mapping[PolicyName, PolicyFactory] = MappingProxyType({
    PolicyName.ROUND_ROBIN: RoundRobinPolicy.from_options,
    PolicyName.LEAST_REQUESTS: LeastRequestsPolicy.from_options,
    PolicyName.LEAST_TOKENS: LeastTokensPolicy.from_options,
    PolicyName.POWER_OF_TWO: PowerOfTwoPolicy.from_options,
    PolicyName.SESSION_AFFINITY: SessionAffinityPolicy.from_options,
    PolicyName.PREFIX_AWARE: PrefixAwarePolicy.from_options,
})


def make_policy(name: PolicyName, options: Mapping[str, Any] | None = None) -> Policy:
    """A new policy instance; raises ValueError on an unknown name or option (config errors)."""
    return _FACTORIES[PolicyName(name)](options or {})
