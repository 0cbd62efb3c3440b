"""A Redis outage never fails a call: a real redis-server is killed (or hung) mid-run, the store answers
from memory with exactly one warning, and switches back to Redis by itself once it is restarted."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis import asyncio as aioredis

from gateway.state import (
    BreakerState,
    MemoryStore,
    RateLimits,
    RedisOptions,
    RedisStore,
    ResilientStore,
    StoreUnavailable,
    Usage,
)
from gateway.state.redis_store import session_keys
from tests.support.ports import free_port
from tests.support.redis_proc import RedisProc
from tests.support.wait import await_until

PREFIX = "resilient:"
LOGGER = "gateway.state.resilient"


class CountingStore:
    """Passes every call through to a store, counting the calls by method name."""

    def __init__(self, inner: RedisStore) -> None:
        self._inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return await method(*args, **kwargs)

        return counted

    def num_calls_besides_ping(self) -> int:
        """Calls that answer requests (the probe's pings while degraded are the only others)."""
        return sum(n for name, n in self.calls.items() if name not in ("ping", "close"))


@pytest.fixture
def proc() -> Iterator[RedisProc]:
    with RedisProc() as server:   # its own server: these tests kill it
        yield server


@pytest.fixture
def primary(proc: RedisProc) -> CountingStore:
    return CountingStore(RedisStore(RedisOptions(url=proc.url, key_prefix=PREFIX)))


@pytest.fixture
async def resilient(primary: CountingStore) -> AsyncIterator[ResilientStore]:
    store = ResilientStore(primary, MemoryStore(), probe_interval_s=0.05)  # type: ignore[arg-type]
    yield store
    await store.close()


async def _exercise_every_call(store: ResilientStore) -> None:
    await store.rate_limit("k", RateLimits(100, 10_000), 10)
    await store.charge_tokens("k", 5)
    await store.set_session("s2", "http://b:2", ttl_s=30)
    assert await store.get_session("s2") == "http://b:2"
    await store.record_usage("k", 1, 0, 1)
    await store.get_usage("k")
    await store.set_breaker("http://a:1", BreakerState.OPEN, ttl_s=30)
    assert await store.get_breaker("http://a:1") is BreakerState.OPEN
    await store.share_inflight("r1", {"http://a:1": (1, 5, 0)}, ttl_s=30)
    assert await store.share_inflight("r2", {}, ttl_s=30) == {"http://a:1": [1, 5, 0]}
    assert await store.ping()


async def _wait_until_back(store: ResilientStore) -> None:
    await await_until(lambda: not store.degraded, "the store to switch back to Redis")


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


async def test_killed_redis_degrades_to_memory_and_recovers(
        proc: RedisProc, primary: CountingStore, resilient: ResilientStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    admin = aioredis.Redis.from_url(proc.url, decode_responses=True)
    await resilient.set_session("s", "http://a:1", ttl_s=30)
    await resilient.record_usage("k", 10, 0, 2)
    assert await admin.hget(session_keys(PREFIX, "s")[0], "e") == "http://a:1"   # really on Redis
    assert not resilient.degraded
    await admin.aclose()

    proc.kill()
    assert (await resilient.rate_limit("k", RateLimits(2, None), 0)).allowed
    assert resilient.degraded                          # detected by the call itself, answered from memory,
    assert primary.calls["rate_limit"] == 1            # after one try at Redis
    num_redis_calls = primary.num_calls_besides_ping()
    assert await resilient.get_session("s") == "http://a:1"   # written through before the outage
    assert (await resilient.rate_limit("k", RateLimits(2, None), 0)).allowed
    assert not (await resilient.rate_limit("k", RateLimits(2, None), 0)).allowed   # still limited
    for _ in range(3):
        await _exercise_every_call(resilient)
    assert len(_records(caplog, logging.WARNING)) == 1
    assert primary.num_calls_besides_ping() == num_redis_calls   # degraded calls do not try Redis again

    proc.restart()                                     # same port, empty
    await _wait_until_back(resilient)
    assert len(_records(caplog, logging.INFO)) == 1
    await resilient.record_usage("k", 3, 1, 4)
    admin = aioredis.Redis.from_url(proc.url, decode_responses=True)
    try:
        assert await admin.hgetall(f"{PREFIX}usage:k") == {"requests": "1", "prompt": "3", "cached": "1",
                                                           "completion": "4"}
    finally:
        await admin.aclose()
    assert await resilient.get_usage("k") == Usage(1, 3, 1, 4)
    await _exercise_every_call(resilient)
    assert not resilient.degraded
    assert len(_records(caplog, logging.WARNING)) == 1


async def test_hung_redis_times_out_to_memory(proc: RedisProc, primary: CountingStore, resilient: ResilientStore,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    await resilient.set_session("s", "http://a:1", ttl_s=30)
    proc.pause()
    try:
        # The socket timeout ends the wait (a bound for a broken run only: the call takes ~0.5 s).
        assert await asyncio.wait_for(resilient.get_session("s"), timeout=30) == "http://a:1"
        assert resilient.degraded
        assert primary.calls["get_session"] == 1
        num_redis_calls = primary.num_calls_besides_ping()
        await _exercise_every_call(resilient)
        assert primary.num_calls_besides_ping() == num_redis_calls   # degraded calls do not wait on Redis again
    finally:
        proc.resume()
    await _wait_until_back(resilient)
    assert await resilient.get_session("s") == "http://a:1"
    assert len(_records(caplog, logging.WARNING)) == 1


async def test_redis_down_at_start_then_started(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    port = free_port()
    store = ResilientStore(RedisStore(RedisOptions(url=f"redis://127.0.0.1:{port}/0",
                                                   key_prefix=f"t-{uuid.uuid4().hex[:8]}:")),
                           MemoryStore(), probe_interval_s=0.05)
    try:
        await _exercise_every_call(store)
        assert store.degraded and len(_records(caplog, logging.WARNING)) == 1
        with RedisProc(port=port):
            await _wait_until_back(store)
            await _exercise_every_call(store)
            assert not store.degraded
    finally:
        await store.close()


async def test_plain_redis_store_raises_store_unavailable(proc: RedisProc) -> None:
    store = RedisStore(RedisOptions(url=proc.url))
    try:
        assert await store.ping()
        proc.kill()
        assert not await store.ping()
        with pytest.raises(StoreUnavailable):
            await store.get_session("s")
    finally:
        await store.close()


async def test_a_transport_closed_under_a_call_is_an_outage(proc: RedisProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop raises RuntimeError, not a RedisError, for a write on a transport closed under it (the server
    died between a connection's connect and its first command); that too must fail over, not answer 500."""
    store = RedisStore(RedisOptions(url=proc.url))
    resilient = ResilientStore(store, MemoryStore(), probe_interval_s=60.0)

    async def closed_transport(*args: object, **kwargs: object) -> object:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    try:
        await store.connect()
        monkeypatch.setattr(store._client, "execute_command", closed_transport)
        with pytest.raises(StoreUnavailable):
            await store.get_session("s")
        assert not await store.ping()
        await resilient.set_session("s", "http://a:1", ttl_s=30)   # answered by the fallback
        assert resilient.degraded and await resilient.get_session("s") == "http://a:1"
    finally:
        await resilient.close()
