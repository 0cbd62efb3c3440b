"""`RedisStore`: the StateStore that gateway replicas share, on one Redis server or on a Redis Cluster.

Every call is one round trip (a Lua script or one command). Keys that one script touches share a hash tag, so
they live in one slot of a cluster. Short socket timeouts and no client-side backoff make an outage surface
within ~0.5 s as `StoreUnavailable`; `ResilientStore` handles it. A redirection (MOVED/ASK) is never an outage.
"""
from __future__ import annotations

import asyncio
import logging
import math
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import AskError, RedisClusterException, RedisError

from gateway.state import bucket, redis_scripts
from gateway.state.base import UNLIMITED, BreakerState, RateDecision, RateLimits, StoreUnavailable, Usage, sum_counts
from gateway.state.redis_client import (
    Client,
    RedisOptions,
    StoreMisconfigured,
    Topology,
    as_cluster_url,
    cluster_client,
    is_cluster_node,
    node_urls,
    plain_client,
    sentinel_client,
    topology,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_USAGE_FIELDS = ("requests", "prompt", "cached", "completion")

# Sessions are spread over this many index shards, each with its own hash tag: a session's key and its shard
# of the index share a slot, and a cluster spreads the shards over its masters.
NUM_SESSION_SHARDS = 16

# What a Redis call raises when the server is gone. RuntimeError: uvloop's "unable to perform operation on
# <TCPTransport closed=True>" when the server dies between a connection's connect and its first command
# (redis-py's HELLO), seen under load in tests/faults/test_redis_outage.py; it is not a RedisError.
# RedisClusterException: a cluster's slot left unserved while a replica takes over, or no node reachable.
_OUTAGE = (RedisError, RedisClusterException, OSError, TimeoutError, RuntimeError)

_SCRIPTS = (redis_scripts.RATE_LIMIT, redis_scripts.CHARGE, redis_scripts.RECORD_USAGE, redis_scripts.GET_SESSION,
            redis_scripts.SET_SESSION, redis_scripts.COUNT_SESSIONS, redis_scripts.SHARE_INFLIGHT)


def session_keys(key_prefix: str, session_key: str) -> tuple[str, str]:
    """The session's hash and the shard of the live-session index it is counted in (one hash tag)."""
    shard = zlib.crc32(session_key.encode()) % NUM_SESSION_SHARDS
    return f"{key_prefix}session:{{{shard}}}:{session_key}", _session_index(key_prefix, shard)


def _session_index(key_prefix: str, shard: int) -> str:
    return f"{key_prefix}sessions:{{{shard}}}"


class RedisStore:
    """StateStore on Redis. Raises `StoreUnavailable` when Redis cannot answer (wrap it in ResilientStore) and
    `StoreMisconfigured` when the URL names a cluster and the server is not one. Which client it uses is
    decided at first contact (`connect`), so a store made while Redis is down still finds a cluster later."""

    def __init__(self, options: RedisOptions) -> None:
        self._options = options
        self._prefix = options.key_prefix
        self._client: Client | None = None
        self._scripts: dict[str, AsyncScript] = {}
        self._connecting = asyncio.Lock()
        # The cluster client's per-node pools fail at max_connections instead of waiting, and the sentinel client's
        # pool is unbounded (a plain server's pool waits): calls beyond it queue here, so a burst is never mistaken
        # for an outage, nor opens a connection per call.
        self._gated_calls = asyncio.Semaphore(options.max_connections)
        self._gated = False   # set with the client (_set_client)

    @classmethod
    def from_url(cls, url: str, key_prefix: str = "switchyard:") -> RedisStore:
        return cls(RedisOptions(url=url, key_prefix=key_prefix))

    @property
    def is_cluster(self) -> bool | None:
        """True on a Redis Cluster, False on one server, None before the first contact."""
        return None if self._client is None else isinstance(self._client, RedisCluster)

    async def connect(self) -> None:
        """Reach Redis now and choose the client (the gateway calls this at start-up): raises `StoreUnavailable`
        if no server answers, `StoreMisconfigured` if a cluster URL names a plain server."""
        await self._run(_nothing)

    async def rate_limit(self, key_id: str, limits: RateLimits, cost_tokens: int) -> RateDecision:
        if limits.unlimited:
            return UNLIMITED
        if cost_tokens < 0:
            raise ValueError("cost_tokens must not be negative")
        allowed, retry_after_s, num_requests, num_tokens = await self._eval(
            redis_scripts.RATE_LIMIT, [self._key("rl", key_id)],
            [limits.max_requests_per_window or 0, limits.max_tokens_per_window or 0, repr(float(limits.window_s)),
             cost_tokens])
        levels = bucket.Levels(float(num_requests), float(num_tokens), 0.0)
        return bucket.decision(levels, limits, bool(allowed), float(retry_after_s))

    async def charge_tokens(self, key_id: str, num_tokens: int) -> None:
        if num_tokens != 0:
            await self._eval(redis_scripts.CHARGE, [self._key("rl", key_id)], [num_tokens])

    async def get_session(self, session_key: str) -> str | None:
        result: str | None = await self._eval(redis_scripts.GET_SESSION, list(session_keys(self._prefix, session_key)))
        return result

    async def set_session(self, session_key: str, endpoint_id: str, ttl_s: float) -> None:
        await self._eval(redis_scripts.SET_SESSION, list(session_keys(self._prefix, session_key)),
                         [endpoint_id, _ms(ttl_s)])

    async def count_sessions(self) -> int:
        """One script per index shard, all at once (for the status page, not a request's path)."""
        counts = await asyncio.gather(*(self._eval(redis_scripts.COUNT_SESSIONS, [_session_index(self._prefix, i)])
                                        for i in range(NUM_SESSION_SHARDS)))
        return sum(int(count) for count in counts)

    async def record_usage(self, key_id: str, num_prompt_tokens: int, num_cached_tokens: int,
                           num_completion_tokens: int) -> None:
        await self._eval(redis_scripts.RECORD_USAGE, [self._key("usage", key_id)],
                         [1, num_prompt_tokens, num_cached_tokens, num_completion_tokens])

    async def get_usage(self, key_id: str) -> Usage:
        values = await self._run(lambda redis: redis.hmget(self._key("usage", key_id), list(_USAGE_FIELDS)))
        counts = [int(v) if v is not None else 0 for v in values]
        return Usage(*counts)

    async def get_breaker(self, endpoint_id: str) -> BreakerState | None:
        value = await self._run(lambda redis: redis.get(self._key("breaker", endpoint_id)))
        return None if value is None else BreakerState(value)

    async def set_breaker(self, endpoint_id: str, state: BreakerState, ttl_s: float) -> None:
        await self._run(lambda redis: redis.set(self._key("breaker", endpoint_id), state.value, px=_ms(ttl_s)))

    async def share_inflight(self, replica_id: str, counts: Mapping[str, Sequence[int]],
                             ttl_s: float) -> dict[str, list[int]]:
        sums = await self._eval(redis_scripts.SHARE_INFLIGHT, [self._key("inflight", "replicas")],
                                [replica_id, _ms(ttl_s), orjson.dumps(counts).decode()])
        return sum_counts([orjson.loads(sums)])   # summed by the script; checked here

    async def publish_routed(self, replica_id: str, payload: str, max_entries: int) -> None:
        await self._run(lambda redis: redis.xadd(self._key("routed", "log"), {"r": replica_id, "p": payload},
                                                 maxlen=max_entries, approximate=True))

    async def read_routed(self, after: str, max_entries: int) -> tuple[str, list[tuple[str, str]]]:
        key = self._key("routed", "log")
        reply: Any = await self._run(lambda redis: redis.xread({key: after}, count=max_entries))
        entries: list[tuple[str, dict[str, str]]] = reply[0][1] if reply else []  # [[key, [(id, fields), ...]]]
        cursor = entries[-1][0] if entries else after
        return cursor, [(fields["r"], fields["p"]) for _, fields in entries]

    async def get_response(self, cache_key: str) -> bytes | None:
        value: Any = await self._run(lambda redis: redis.get(self._key("resp", cache_key)))
        return None if value is None else value.encode()

    async def put_response(self, cache_key: str, body: bytes, ttl_s: float) -> None:
        await self._run(lambda redis: redis.set(self._key("resp", cache_key), body.decode(),
                                                px=max(1, int(ttl_s * 1000))))

    async def ping(self) -> bool:
        """On a cluster, every master must answer: a slot whose master is gone (before its replica took over)
        is not back yet. Raises `StoreMisconfigured` only (a cluster URL at a plain server)."""
        try:
            await self._run(lambda redis: redis.ping(target_nodes=RedisCluster.PRIMARIES)
                            if isinstance(redis, RedisCluster) else redis.ping())
        except StoreUnavailable:
            return False
        return True

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _key(self, kind: str, name: str) -> str:
        return f"{self._prefix}{kind}:{name}"

    async def _eval(self, script: str, keys: list[str], args: Sequence[Any] = ()) -> Any:
        return await self._run(lambda redis: self._scripts[script](keys=keys, args=list(args), client=redis))

    async def _run(self, call: Callable[[Any], Awaitable[T]]) -> T:
        """Run one call on the client, turning connection errors and timeouts into `StoreUnavailable`. A plain
        client that is redirected (MOVED/ASK: the server is a cluster node after all) switches to the cluster
        client and runs the call again, rather than count a misconfiguration as an outage."""
        try:
            client = await self._connected()
            try:
                if self._gated:
                    async with self._gated_calls:
                        return await call(client)
                return await call(client)
            except AskError as exc:          # MovedError is an AskError
                if isinstance(client, RedisCluster):
                    raise
                log.warning("redis answered %s: %s is a cluster node; using the cluster client", exc,
                            self._options.url)
                await self._use_cluster(client)
                return await call(await self._connected())
        except _OUTAGE as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    async def _connected(self) -> Client:
        if self._client is None:
            async with self._connecting:
                if self._client is None:
                    self._set_client(await self._open())
        assert self._client is not None
        return self._client

    def _set_client(self, client: Client) -> None:
        self._client = client
        self._gated = isinstance(client, RedisCluster) or topology(self._options.url) is Topology.SENTINEL
        self._scripts = {script: client.register_script(script) for script in _SCRIPTS}

    async def _open(self) -> Client:
        """The sentinels' master; else ask the URL's nodes, in order, whether they run in cluster mode: the first
        that answers decides."""
        if topology(self._options.url) is Topology.SENTINEL:
            return sentinel_client(self._options)
        is_cluster: bool | None = None
        last_outage: BaseException | None = None
        for url in node_urls(self._options.url):
            probe = plain_client(replace(self._options, url=url, max_connections=1))
            try:
                is_cluster = await is_cluster_node(probe)
                break
            except _OUTAGE as exc:
                last_outage = exc
            finally:
                await probe.aclose()
        if is_cluster is None:
            assert last_outage is not None
            raise last_outage
        if topology(self._options.url) is Topology.CLUSTER:
            if not is_cluster:
                raise StoreMisconfigured(f"redis_url names a cluster, but {url} is not in cluster mode")
            return await _initialized(cluster_client(self._options))
        if is_cluster:
            log.info("redis at %s is a cluster node: sharing state through the cluster", url)
            return await _initialized(cluster_client(replace(self._options, url=as_cluster_url(self._options.url))))
        return plain_client(self._options)

    async def _use_cluster(self, plain: Client) -> None:
        async with self._connecting:
            if self._client is plain:
                url = as_cluster_url(self._options.url)
                self._set_client(await _initialized(cluster_client(replace(self._options, url=url))))
        await plain.aclose()


async def _initialized(client: RedisCluster) -> RedisCluster:
    """Read the slot map before the first call: redis-py 8.1's cluster client, first used by many calls at
    once, can hand one of them a connection that another is closing (AttributeError on `writelines`)."""
    try:
        await client.initialize()
    except BaseException:
        await client.aclose()
        raise
    return client


async def _nothing(client: Client) -> None:
    return None


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))
