"""Shared gateway state (rate limits, sessions, usage, breakers, in-flight tokens) behind `StateStore`.

`make_store(None)` is the embedded in-process store; `make_store(url)` shares state through Redis and
degrades to in-process state during a Redis outage.
"""
from __future__ import annotations

from gateway.state.base import (
    UNLIMITED,
    BreakerState,
    RateDecision,
    RateLimits,
    StateStore,
    StoreUnavailable,
    Usage,
)
from gateway.state.memory import MemoryStore
from gateway.state.redis_store import RedisOptions, RedisStore
from gateway.state.resilient import ResilientStore

__all__ = [
    "UNLIMITED", "BreakerState", "MemoryStore", "RateDecision", "RateLimits", "RedisOptions", "RedisStore",
    "ResilientStore", "StateStore", "StoreUnavailable", "Usage", "make_store",
]


def make_store(redis_url: str | None, key_prefix: str = "switchyard:", probe_interval_s: float = 1.0,
               max_response_bytes: int = 64 << 20) -> StateStore:
    """The store for a gateway: in-process without Redis, else Redis with an in-process fallback.
    Call inside the running loop (the Redis pool binds to it); close it at shutdown. `max_response_bytes`:
    what the in-process store keeps of cached answers."""
    if redis_url is None:
        return MemoryStore(max_response_bytes=max_response_bytes)
    primary = RedisStore(RedisOptions(url=redis_url, key_prefix=key_prefix))
    return ResilientStore(primary, MemoryStore(max_response_bytes=max_response_bytes),
                          probe_interval_s=probe_interval_s)
