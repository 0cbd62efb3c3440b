"""Fixtures: each store kind (in-process, one real redis-server, a real Redis Cluster, a real master with its replica
behind Redis Sentinel) with a fresh key namespace."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from gateway.state import MemoryStore, RedisOptions, RedisStore, StateStore
from tests.support.redis_cluster_proc import RedisClusterProc
from tests.support.redis_proc import RedisProc
from tests.support.redis_sentinel_proc import RedisSentinelProc

KINDS = ["memory", "redis", "redis-cluster", "redis-sentinel"]


class FakeClock:
    """A clock for MemoryStore that moves only when the test says so."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    async def advance(self, seconds: float) -> None:
        self.now_s += seconds


# Reads and connects for the tests that are not about noticing an outage. The product's 0.25 s would call a loaded
# CI machine's stall an outage: a cluster client's first call reads the ~100 KB COMMAND reply, and one test failed
# on that read at 0.25 s.
ROOMY_TIMEOUT_S = 5.0


def redis_options(url: str, key_prefix: str = "switchyard:") -> RedisOptions:
    return RedisOptions(url=url, key_prefix=key_prefix, socket_timeout_s=ROOMY_TIMEOUT_S,
                        connect_timeout_s=ROOMY_TIMEOUT_S)


def redis_store(url: str) -> RedisStore:
    """A client with its own key prefix, so tests sharing one server never see each other's keys."""
    return RedisStore(redis_options(url, f"test-{uuid.uuid4().hex[:12]}:"))


@pytest.fixture(scope="session")
def redis_sentinel_session() -> Iterator[RedisSentinelProc]:
    """One master, replica and sentinel for the session's tests (each test keeps to its own key prefix); the master
    is called down only after 30 s unanswered, so no stall of a loaded machine fails it over under a test."""
    with RedisSentinelProc(down_after_ms=30_000) as sentinel:
        yield sentinel


def redis_url(request: pytest.FixtureRequest, kind: str) -> str:
    """A fresh server's URL, the session's Redis Cluster (reached by one node's plain URL), or the session's
    sentinel and the master it names."""
    if kind == "redis-cluster":
        cluster: RedisClusterProc = request.getfixturevalue("redis_cluster_session")
        return cluster.url
    if kind == "redis-sentinel":
        sentinel: RedisSentinelProc = request.getfixturevalue("redis_sentinel_session")
        return sentinel.url
    server: RedisProc = request.getfixturevalue("redis_server")
    return server.url


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    """Each test using it runs once per store kind: they must behave the same."""
    if request.param == "memory":
        yield MemoryStore()
        return
    redis = redis_store(redis_url(request, request.param))
    yield redis
    await redis.close()


Wait = Callable[[float], Awaitable[None]]   # lets this many seconds pass for a store


@pytest.fixture(params=KINDS)
async def clocked_store(request: pytest.FixtureRequest) -> AsyncIterator[tuple[StateStore, Wait]]:
    """A store and how to let time pass for it: MemoryStore runs on a FakeClock that the test moves,
    Redis reads its own clock, so there the time really has to pass."""
    if request.param == "memory":
        clock = FakeClock()
        yield MemoryStore(clock=clock), clock.advance
        return
    redis = redis_store(redis_url(request, request.param))
    yield redis, asyncio.sleep
    await redis.close()
