"""Shared gateway state (rate limits, sessions, usage, breakers, in-flight tokens) behind `StateStore`.

`make_store(None)` is the embedded in-process store; `make_store(url)` shares state through Redis (one server
or a Redis Cluster) and degrades to in-process state during a Redis outage. `open_store` also reaches Redis
at once, so that a URL that names the wrong kind of Redis stops the gateway at start-up.
"""
from __future__ import annotations

import logging

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
from gateway.state.redis_client import RedisOptions, StoreMisconfigured
from gateway.state.redis_store import RedisStore
from gateway.state.resilient import ResilientStore

__all__ = [
    "UNLIMITED", "BreakerState", "MemoryStore", "RateDecision", "RateLimits", "RedisOptions", "RedisStore",
    "ResilientStore", "StateStore", "StoreMisconfigured", "StoreUnavailable", "Usage", "make_store", "open_store",
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



async def open_store(redis_url: str | None, key_prefix: str = "switchyard:", probe_interval_s: float = 1.0,
                     max_response_bytes: int = 64 << 20) -> StateStore:
    """`make_store`, then a first contact with Redis: raises `StoreMisconfigured` (a cluster URL at a plain
    server); a Redis that does not answer yet is an outage like any other (served from in-process state)."""
    store = make_store(redis_url, key_prefix, probe_interval_s, max_response_bytes)
    if isinstance(store, ResilientStore) and isinstance(store.primary, RedisStore):
        try:
            await store.primary.connect()
        except StoreUnavailable as exc:
            logging.getLogger(__name__).warning("redis is not reachable at start-up (%s): in-process state "
                                                "until it answers", exc)
        except StoreMisconfigured:
            await store.close()
            raise
    return store
