"""The records and the `StateStore` protocol that gateway replicas share state through.

Owns only the interface; implementations are `memory.MemoryStore` (one replica), `redis_store.RedisStore`
(many replicas) and `resilient.ResilientStore` (Redis that degrades to memory during an outage).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol


class StoreUnavailable(Exception):
    """The backing service (Redis) could not answer: an outage, not a bug. `ResilientStore` catches it."""


@dataclass(frozen=True, slots=True)
class RateLimits:
    max_requests_per_window: int | None  # bucket size (burst) and refill per window; None: unlimited
    max_tokens_per_window: int | None    # prompt + completion tokens per window; None: unlimited
    window_s: float = 60.0               # the bucket refills completely in this long

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("window_s must be positive")
        for limit in (self.max_requests_per_window, self.max_tokens_per_window):
            if limit is not None and limit <= 0:
                raise ValueError("rate limits must be positive (None: unlimited)")

    @property
    def unlimited(self) -> bool:
        return self.max_requests_per_window is None and self.max_tokens_per_window is None


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool                     # False: answer 429
    retry_after_s: float              # 0 when allowed; else how long until this request would pass
    remaining_requests: int | None    # requests that could pass now (after this one); None: unlimited
    remaining_tokens: int | None      # tokens that could be spent now (never below 0); None: unlimited
    reset_requests_s: float | None    # until the request bucket is full again; None: unlimited
    reset_tokens_s: float | None      # until the token bucket is full again; None: unlimited


# What `rate_limit` answers when a key has no limits (no state is touched).
UNLIMITED = RateDecision(allowed=True, retry_after_s=0.0, remaining_requests=None, remaining_tokens=None,
                         reset_requests_s=None, reset_tokens_s=None)


@dataclass(frozen=True, slots=True)
class Usage:
    num_requests: int = 0             # requests recorded for the key
    num_prompt_tokens: int = 0        # prompt tokens, cached ones included
    num_cached_tokens: int = 0        # prompt tokens served from a prefix cache
    num_completion_tokens: int = 0    # generated tokens


class BreakerState(str, Enum):
    """A circuit breaker's state as shared between replicas."""
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class StateStore(Protocol):
    """State shared by gateway replicas. Implementations never block the loop and are safe to share
    between tasks. `RedisStore` raises `StoreUnavailable` on an outage; the others never do."""

    async def rate_limit(self, key_id: str, limits: RateLimits, cost_tokens: int) -> RateDecision:
        """Take one request and `cost_tokens` (an estimate) from the key's buckets, atomically across
        replicas, if both have room; otherwise take nothing and say how long to wait."""
        ...

    async def charge_tokens(self, key_id: str, num_tokens: int) -> None:
        """Settle the estimate: take `num_tokens` more (actual - estimated; negative refunds). May push
        the token bucket below zero, so later requests wait for the debt to refill."""
        ...

    async def get_session(self, session_key: str) -> str | None:
        """The session's endpoint, refreshing its TTL; None if unknown or expired."""
        ...

    async def set_session(self, session_key: str, endpoint_id: str, ttl_s: float) -> None: ...

    async def count_sessions(self) -> int:
        """Sessions not yet expired, over all replicas (for the status page)."""
        ...

    async def record_usage(self, key_id: str, num_prompt_tokens: int, num_cached_tokens: int,
                           num_completion_tokens: int) -> None:
        """Add one request and its token counts to the key's usage counters."""
        ...

    async def get_usage(self, key_id: str) -> Usage: ...

    async def get_breaker(self, endpoint_id: str) -> BreakerState | None:
        """The state some replica last shared for the endpoint; None if none or expired."""
        ...

    async def set_breaker(self, endpoint_id: str, state: BreakerState, ttl_s: float) -> None: ...

    async def share_inflight(self, replica_id: str, counts: Mapping[str, Sequence[int]],
                             ttl_s: float) -> dict[str, list[int]]:
        """Publish this replica's in-flight counts per endpoint (replacing its last ones; forgotten after `ttl_s`
        unless published again) and return the other live replicas' counts summed per endpoint, position by
        position: one round trip however many endpoints."""
        ...

    async def publish_routed(self, replica_id: str, payload: str, max_entries: int) -> None:
        """Append one batch of this replica's routing decisions (gateway/routing/prefix_share.py) to the shared log,
        which keeps about the latest `max_entries` batches."""
        ...

    async def read_routed(self, after: str, max_entries: int) -> tuple[str, list[tuple[str, str]]]:
        """Up to `max_entries` batches appended after the cursor `after`, oldest first, as (replica id,
        payload), and the cursor past them. A cursor is a Redis stream id, "MS-N": "0-0" reads from the
        oldest batch kept, "MS-0" from the first appended after MS, milliseconds since the epoch."""
        ...

    async def get_response(self, cache_key: str) -> bytes | None:
        """A cached answer's body (gateway/routing/response_cache.py); None when there is none."""
        ...

    async def put_response(self, cache_key: str, body: bytes, ttl_s: float) -> None: ...

    async def ping(self) -> bool:
        """True if the store answers now; never raises for an outage."""
        ...

    async def close(self) -> None: ...


def sum_counts(replicas: Iterable[Any]) -> dict[str, list[int]]:
    """Per endpoint, the position-by-position sum of the replicas' counts (`share_inflight`). A replica's
    entry that is not a mapping of endpoint to a list of integers (another version's, say) is skipped."""
    sums: dict[str, list[int]] = {}
    for counts in replicas:
        if not isinstance(counts, Mapping):
            continue
        for endpoint_id, values in counts.items():
            if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
                continue
            total = sums.setdefault(endpoint_id, [0] * len(values))
            if len(total) < len(values):
                total.extend([0] * (len(values) - len(total)))
            for i, value in enumerate(values):
                total[i] += value
    return sums
