"""Fixtures: one real redis-server per test session, and each store kind with a fresh key namespace."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.state import MemoryStore, RedisOptions, RedisStore, StateStore
from tests.support.redis_proc import RedisProc, redis_server_path

@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProc]:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    with RedisProc() as proc:
        yield proc


def redis_store(url: str) -> RedisStore:
    """A client with its own key prefix, so tests sharing one server never see each other's keys."""
    return RedisStore(RedisOptions(url=url, key_prefix=f"test-{uuid.uuid4().hex[:12]}:"))


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    """Each test using it runs once per store kind: the two must behave the same."""
    if request.param == "memory":
        yield MemoryStore()
        return
    server: RedisProc = request.getfixturevalue("redis_server")
    redis = redis_store(server.url)
    yield redis
    await redis.close()
