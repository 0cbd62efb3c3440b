"""The routing contract: what a policy sees (`RequestFacts`, `EndpointState`), what it returns
(`Decision`), the `Policy` protocol, and the small helpers every policy shares (token cost,
random tie-breaking, option parsing). Pure and synchronous: no I/O, no clocks.
"""
from __future__ import annotations

import enum
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol, TypeVar


class DecisionReason(str, enum.Enum):
    BALANCED = "balanced"              # chosen by load alone (round robin, least load, p2c, fallback)
    AFFINITY_HIT = "affinity_hit"      # the session stayed on its current endpoint
    AFFINITY_NEW = "affinity_new"      # a session without an assignment got its ring home
    AFFINITY_MOVED = "affinity_moved"  # the session's endpoint was unusable or over the load bound
    PREFIX_HIT = "prefix_hit"          # chosen where some of the prompt's leading blocks are cached
    PREFIX_AFFINITY = "prefix_affinity"  # no session header: the ring home of a key from the prompt's prefix


# The records a policy reads and returns are built for every request (an EndpointState for every candidate):
# NamedTuples, as immutable as frozen dataclasses but built without one `object.__setattr__` call per field,
# which cost the gateway 7% of its instructions per request (docs/gateway_performance.md, change 10).
class RequestFacts(NamedTuple):
    model: str                       # the model name the client sent
    num_prompt_tokens: int           # counted with the model's tokenizer (or estimated)
    num_expected_output_tokens: int  # from max_tokens and observed output lengths
    block_hashes: tuple[int, ...]    # cache.block_hash.block_hashes(prompt ids, block_size)
    session_key: str | None          # x-session-affinity header
    session_endpoint: str | None     # the session's current assignment from the state store
    block_size: int = 16             # tokens per block behind block_hashes (the model's, from config)


class EndpointState(NamedTuple):
    endpoint_id: str                 # the endpoint's base URL
    healthy: bool                    # circuit closed/half-open-probe-allowed and last health ok
    num_requests: int                # requests in flight from this gateway (and peers, when shared)
    num_prefill_tokens: int          # prompt tokens still to prefill there
    num_decode_tokens: int           # output tokens still to decode there
    num_matched_blocks: int          # leading blocks of THIS request's prompt cached on its device (prefix index)
    kv_free_fraction: float | None   # from the worker's load report, when it has one
    # The prompt's leading run past `num_matched_blocks` that its KV tiers hold, as (cpu, disk, store) blocks
    # by the medium each is read from (cache.tier_runs.MatchedByMedium).
    num_tier_matched_blocks: tuple[int, int, int] = (0, 0, 0)
    # Reading a token back from each of those media, as a fraction of computing it, as the worker measured it
    # (its load report); None where it has not. Filled in only when some tier holds part of the prompt.
    tier_restore_fractions: tuple[float | None, float | None, float | None] = (None, None, None)


class Decision(NamedTuple):
    endpoint_id: str                 # the chosen endpoint (one of the candidates passed to select)
    reason: DecisionReason           # why it was chosen (logged and counted by the gateway)
    session_moved_from: str | None   # set when a session was re-homed (gateway records it + metric)


class Policy(Protocol):
    def select(self, request: RequestFacts, endpoints: Sequence[EndpointState]) -> Decision | None:
        """Choose one of `endpoints` (the gateway's remaining candidates); None: none is usable."""
        ...


@dataclass(frozen=True, slots=True)
class TokenWeights:
    prefill_weight: float = 1.0      # cost of one prompt token still to prefill
    decode_weight: float = 1.0       # cost of one output token still to decode

    def __post_init__(self) -> None:
        check_number("prefill_weight", self.prefill_weight, minimum=0.0)
        check_number("decode_weight", self.decode_weight, minimum=0.0)

    def cost(self, endpoint: EndpointState) -> float:
        """Tokens in flight at `endpoint`, weighted by phase."""
        return (self.prefill_weight * endpoint.num_prefill_tokens
                + self.decode_weight * endpoint.num_decode_tokens)


def pick_least(endpoints: Sequence[EndpointState], cost: Callable[[EndpointState], float],
               rng: random.Random) -> EndpointState | None:
    """The healthy endpoint of least `cost`; ties go to a uniformly random one (reservoir
    sampling in one pass), never always to the first, so equal endpoints share the load."""
    best: EndpointState | None = None
    best_cost = float("inf")
    num_ties = 0
    for endpoint in endpoints:
        if not endpoint.healthy:
            continue
        c = cost(endpoint)
        if c < best_cost:
            best, best_cost, num_ties = endpoint, c, 1
        elif c == best_cost:
            num_ties += 1
            if rng.random() * num_ties < 1.0:
                best = endpoint
    return best


def check_number(name: str, value: object, minimum: float | None = None) -> None:
    """Raise ValueError unless `value` is a real number (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"policy option {name!r} must be a number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"policy option {name!r} must be >= {minimum}, got {value!r}")


def check_seed(seed: object) -> None:
    """Raise ValueError unless `seed` is None or an int."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"policy option 'seed' must be an integer, got {seed!r}")


def prefix_affinity_key(block_hashes: Sequence[int], block_size: int, num_key_tokens: int) -> str | None:
    """The affinity key of a request without `x-session-affinity`: the chained hash of its first
    `num_key_tokens` tokens' blocks (of all its full blocks when shorter). A chained hash names the
    whole prefix before it, so prompts that share those tokens (a conversation's turns, an agent's
    system prompt and task) share the key; None: no full block, or derivation is off (0 tokens)."""
    if num_key_tokens <= 0 or not block_hashes:
        return None
    num_blocks = min(len(block_hashes), max(1, num_key_tokens // block_size))
    return f"prefix:{block_hashes[num_blocks - 1]:x}"


ConfigT = TypeVar("ConfigT")


def config_from_options(config_type: type[ConfigT], options: Mapping[str, Any]) -> ConfigT:
    """Build a policy's frozen config dataclass from config-file options, rejecting unknown keys
    (a typo in the config must fail at start-up, not silently use a default)."""
    names = {f.name for f in fields(config_type)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"unknown policy option(s) {unknown}; allowed: {sorted(names)}")
    return config_type(**options)


def within_load_bound(endpoints: Sequence[EndpointState], weights: TokenWeights,
                      load_factor: float) -> list[EndpointState]:
    """Healthy endpoints whose load (weighted tokens in flight + 1, so an idle fleet is not
    0/0) is at most `load_factor` x the mean load; never empty while one endpoint is healthy."""
    pw, dw = weights.prefill_weight, weights.decode_weight
    loads = [(e, pw * e.num_prefill_tokens + dw * e.num_decode_tokens + 1.0)
             for e in endpoints if e.healthy]
    if not loads:
        return []
    total = 0.0
    for _, load in loads:
        total += load
    bound = load_factor * total / len(loads) * (1.0 + 1e-9)  # float noise must not exclude the least loaded
    return [e for e, load in loads if load <= bound]
