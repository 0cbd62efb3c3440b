"""Routing decisions only: given a request's facts and the endpoints' state, choose one.
Pure, synchronous, fast, no I/O."""
from policies.base import Decision, DecisionReason, EndpointState, Policy, RequestFacts
from policies.registry import PolicyName, make_policy

__all__ = ["Decision", "DecisionReason", "EndpointState", "Policy", "PolicyName", "RequestFacts",
           "make_policy"]
