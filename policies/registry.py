"""Policy names (as written in the config), each with its factory: the enum is the registry. Adding a policy =
one file in policies/ and one member of `PolicyName` (`NAME = "name", NamePolicy.from_options`)."""
from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

from policies.base import Policy
from policies.least_requests import LeastRequestsPolicy
from policies.least_tokens import LeastTokensPolicy
from policies.power_of_two import PowerOfTwoPolicy
from policies.prefix_aware import PrefixAwarePolicy
from policies.round_robin import RoundRobinPolicy
from policies.session_affinity import SessionAffinityPolicy

PolicyFactory = Callable[[Mapping[str, Any]], Policy]


class PolicyName(str, enum.Enum):
    factory: PolicyFactory    # the member's policy, built from the config's options

    def __new__(cls, value: str, *factory: PolicyFactory) -> PolicyName:
        """A member, `NAME = "name", factory`; a lookup by value, `PolicyName("name")`, never comes here (the
        enum's machinery answers it), though mypy checks it against this signature."""
        member = str.__new__(cls, value)
        member._value_ = value
        member.factory = factory[0]
        return member

    ROUND_ROBIN = "round_robin", RoundRobinPolicy.from_options
    LEAST_REQUESTS = "least_requests", LeastRequestsPolicy.from_options
    LEAST_TOKENS = "least_tokens", LeastTokensPolicy.from_options
    POWER_OF_TWO = "power_of_two", PowerOfTwoPolicy.from_options
    SESSION_AFFINITY = "session_affinity", SessionAffinityPolicy.from_options
    PREFIX_AWARE = "prefix_aware", PrefixAwarePolicy.from_options


def make_policy(name: PolicyName, options: Mapping[str, Any] | None = None) -> Policy:
    """A new policy instance; raises ValueError on an unknown name or option (config errors)."""
    return PolicyName(name).factory(options or {})
