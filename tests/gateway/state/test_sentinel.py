"""RedisStore behind a real Redis Sentinel: the master the sentinel names serves it (every other store behaviour runs
there through the `store` fixtures, tests/gateway/state/conftest.py); a URL without a service is refused; and when
the master dies the gateway's store serves in-process state until the sentinel has promoted the replica, then
shares state through the promoted replica."""
from __future__ import annotations

import uuid

import pytest
import redis

from gateway.config.gateway_config import parse_config
from gateway.state import MemoryStore, RateLimits, RedisOptions, RedisStore, ResilientStore, StoreMisconfigured
from gateway.state.redis_store import session_keys
from tests.gateway.state.conftest import redis_options
from tests.support.redis_proc import RedisProc
from tests.support.redis_sentinel_proc import SERVICE, RedisSentinelProc
from tests.support.wait import await_until, wait_until

DAY_S = 86_400.0


def _prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


def _has_key(server: RedisProc, key: str) -> bool:
    """Whether `server` itself holds `key` (a plain client: no sentinel asked)."""
    with redis.Redis(host=server.host, port=server.port, socket_timeout=2.0) as client:
        return bool(client.exists(key))


async def test_a_sentinel_url_reaches_the_master_it_names(redis_sentinel_session: RedisSentinelProc) -> None:
    prefix = _prefix()
    store = RedisStore(redis_options(redis_sentinel_session.url, prefix))
    try:
        limits = RateLimits(3, None, window_s=DAY_S)
        assert [(await store.rate_limit("k", limits, 0)).allowed for _ in range(4)] == [True] * 3 + [False]
        await store.set_session("m\x00s", "http://a:1", ttl_s=60)
        assert await store.get_session("m\x00s") == "http://a:1"
        assert store.is_cluster is False
        key, _ = session_keys(prefix, "m\x00s")
        assert _has_key(redis_sentinel_session.master, key)    # written on the master, not on the replica
    finally:
        await store.close()
    config = parse_config(f'{{"models": {{}}, "providers": {{}}, "redis_url": "{redis_sentinel_session.url}"}}', {})
    assert config.redis_url == redis_sentinel_session.url


@pytest.mark.parametrize("url", ["redis+sentinel://127.0.0.1:1", "redis+sentinel://127.0.0.1:1/svc/x",
                                 "redis+sentinel:///svc"])
async def test_a_sentinel_url_without_a_service_or_sentinel_is_refused(url: str) -> None:
    store = RedisStore(RedisOptions(url=url))
    with pytest.raises(StoreMisconfigured, match="sentinel"):
        await store.connect()
    await store.close()


async def test_a_failover_is_served_in_process_then_by_the_promoted_replica() -> None:
    with RedisSentinelProc() as sentinel:
        prefix = _prefix()
        store = ResilientStore(RedisStore(RedisOptions(url=sentinel.url, key_prefix=prefix)), MemoryStore(),
                               probe_interval_s=0.1)
        try:
            await store.set_session("m\x00before", "http://a:1", ttl_s=600)
            before, _ = session_keys(prefix, "m\x00before")
            wait_until(lambda: _has_key(sentinel.replica, before), "the session replicated")
            sentinel.master.kill()
            limits = RateLimits(1000, None, window_s=DAY_S)

            async def served_in_process() -> bool:   # every call is answered meanwhile, none raises
                return (await store.rate_limit("k", limits, 0)).allowed and store.degraded

            await await_until(served_in_process, "the store to notice the dead master")
            wait_until(lambda: sentinel.master_port() == sentinel.replica.port,
                       f"the sentinel to promote the replica ({SERVICE})", timeout_s=30.0)

            async def back() -> bool:
                await store.rate_limit("k", limits, 0)
                return not store.degraded

            await await_until(back, "the store to reach the promoted replica", timeout_s=30.0)
            await store.set_session("m\x00after", "http://b:2", ttl_s=600)
            after, _ = session_keys(prefix, "m\x00after")
            assert _has_key(sentinel.replica, after)                        # the promoted replica holds it
            assert await store.get_session("m\x00before") == "http://a:1"  # and what the master had
        finally:
            await store.close()
