"""`RedisStore`: the StateStore that gateway replicas share, on redis-py asyncio with a connection pool.

Every call is one round trip (a Lua script or a pipeline). Short socket timeouts and no client-side
backoff make an outage surface within ~0.5 s as `StoreUnavailable`; `ResilientStore` handles it.
"""
from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.state import bucket, redis_scripts
from gateway.state.base import UNLIMITED, BreakerState, RateDecision, RateLimits, StoreUnavailable, Usage, sum_counts

T = TypeVar("T")

_USAGE_FIELDS = ("requests", "prompt", "cached", "completion")


# What a Redis call raises when the server is gone. RuntimeError: uvloop's "unable to perform operation on
# <TCPTransport closed=True>" when the server dies between a connection's connect and its first command
# (redis-py's HELLO), seen under load in tests/faults/test_redis_outage.py; it is not a RedisError.
_OUTAGE = (RedisError, OSError, TimeoutError, RuntimeError)


@dataclass(frozen=True, slots=True)
class RedisOptions:
    url: str                              # redis://[user:pass@]host:port/db or rediss:// for TLS
    key_prefix: str = "switchyard:"       # namespaces every key (several deployments may share a Redis)
    socket_timeout_s: float = 0.25        # per read/write; an outage is detected this fast
    connect_timeout_s: float = 0.25       # TCP connect
    max_connections: int = 64             # pool size (a request takes one for one round trip)
    pool_timeout_s: float = 1.0           # wait this long for a free pooled connection
    num_retries: int = 1                  # immediate retries on a fresh connection (stale pool after a restart)


class RedisStore:
    """StateStore on Redis. Raises `StoreUnavailable` when Redis cannot answer (wrap it in ResilientStore)."""

    def __init__(self, options: RedisOptions) -> None:
        self._prefix = options.key_prefix
        # A blocking pool: a burst beyond max_connections waits briefly instead of failing as an "outage".
        pool = aioredis.BlockingConnectionPool.from_url(
            options.url, max_connections=options.max_connections, timeout=options.pool_timeout_s,
            socket_timeout=options.socket_timeout_s, socket_connect_timeout=options.connect_timeout_s,
            retry=Retry(NoBackoff(), options.num_retries), decode_responses=True)
        self._redis = aioredis.Redis.from_pool(pool)
        self._rate_limit = self._redis.register_script(redis_scripts.RATE_LIMIT)
        self._charge = self._redis.register_script(redis_scripts.CHARGE)
        self._get_session = self._redis.register_script(redis_scripts.GET_SESSION)
        self._set_session = self._redis.register_script(redis_scripts.SET_SESSION)
        self._count_sessions = self._redis.register_script(redis_scripts.COUNT_SESSIONS)
        self._share_inflight = self._redis.register_script(redis_scripts.SHARE_INFLIGHT)

    @classmethod
    def from_url(cls, url: str, key_prefix: str = "switchyard:") -> RedisStore:
        return cls(RedisOptions(url=url, key_prefix=key_prefix))

    async def rate_limit(self, key_id: str, limits: RateLimits, cost_tokens: int) -> RateDecision:
        if limits.unlimited:
            return UNLIMITED
        if cost_tokens < 0:
            raise ValueError("cost_tokens must not be negative")
        allowed, retry_after_s, num_requests, num_tokens = await self._run(self._rate_limit(
            keys=[self._key("rl", key_id)],
            args=[limits.max_requests_per_window or 0, limits.max_tokens_per_window or 0,
                  repr(float(limits.window_s)), cost_tokens]))
        levels = bucket.Levels(float(num_requests), float(num_tokens), 0.0)
        return bucket.decision(levels, limits, bool(allowed), float(retry_after_s))

    async def charge_tokens(self, key_id: str, num_tokens: int) -> None:
        if num_tokens != 0:
            await self._run(self._charge(keys=[self._key("rl", key_id)], args=[num_tokens]))

    async def get_session(self, session_key: str) -> str | None:
        return await self._run(self._get_session(keys=[self._key("session", session_key), self._sessions_index]))

    async def set_session(self, session_key: str, endpoint_id: str, ttl_s: float) -> None:
        await self._run(self._set_session(keys=[self._key("session", session_key), self._sessions_index],
                                          args=[endpoint_id, _ms(ttl_s)]))

    async def count_sessions(self) -> int:
        return int(await self._run(self._count_sessions(keys=[self._sessions_index])))

    @property
    def _sessions_index(self) -> str:
        return f"{self._prefix}sessions"

    async def record_usage(self, key_id: str, num_prompt_tokens: int, num_cached_tokens: int,
                           num_completion_tokens: int) -> None:
        key = self._key("usage", key_id)
        pipe = self._redis.pipeline(transaction=True)
        amounts = (1, num_prompt_tokens, num_cached_tokens, num_completion_tokens)
        for field, amount in zip(_USAGE_FIELDS, amounts, strict=True):
            pipe.hincrby(key, field, amount)
        await self._run(pipe.execute())

    async def get_usage(self, key_id: str) -> Usage:
        values = await self._run(self._redis.hmget(self._key("usage", key_id), list(_USAGE_FIELDS)))
        counts = [int(v) if v is not None else 0 for v in values]
        return Usage(*counts)

    async def get_breaker(self, endpoint_id: str) -> BreakerState | None:
        value = await self._run(self._redis.get(self._key("breaker", endpoint_id)))
        return None if value is None else BreakerState(value)

    async def set_breaker(self, endpoint_id: str, state: BreakerState, ttl_s: float) -> None:
        await self._run(self._redis.set(self._key("breaker", endpoint_id), state.value, px=_ms(ttl_s)))

    async def share_inflight(self, replica_id: str, counts: Mapping[str, Sequence[int]],
                             ttl_s: float) -> dict[str, list[int]]:
        sums = await self._run(self._share_inflight(
            keys=[self._key("inflight", "replicas")], args=[replica_id, _ms(ttl_s), orjson.dumps(counts).decode()]))
        return sum_counts([orjson.loads(sums)])   # summed by the script; checked here

    async def publish_routed(self, replica_id: str, payload: str, max_entries: int) -> None:
        await self._run(self._redis.xadd(self._key("routed", "log"), {"r": replica_id, "p": payload},
                                         maxlen=max_entries, approximate=True))

    async def read_routed(self, after: str, max_entries: int) -> tuple[str, list[tuple[str, str]]]:
        key = self._key("routed", "log")
        reply: Any = await self._run(self._redis.xread({key: after}, count=max_entries))
        entries: list[tuple[str, dict[str, str]]] = reply[0][1] if reply else []  # [[key, [(id, fields), ...]]]
        cursor = entries[-1][0] if entries else after
        return cursor, [(fields["r"], fields["p"]) for _, fields in entries]

    async def get_response(self, cache_key: str) -> bytes | None:
        value: Any = await self._run(self._redis.get(self._key("resp", cache_key)))
        return None if value is None else value.encode()

    async def put_response(self, cache_key: str, body: bytes, ttl_s: float) -> None:
        await self._run(self._redis.set(self._key("resp", cache_key), body.decode(), px=max(1, int(ttl_s * 1000))))

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except _OUTAGE:
            return False

    async def close(self) -> None:
        await self._redis.aclose()

    def _key(self, kind: str, name: str) -> str:
        return f"{self._prefix}{kind}:{name}"

    @staticmethod
    async def _run(call: Awaitable[T]) -> T:
        """Await one Redis call, turning connection errors and timeouts into `StoreUnavailable`."""
        try:
            return await call
        except _OUTAGE as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))

