"""Sessions, usage, breakers and in-flight tokens on both stores; what only Redis does (replicas sharing
one limit atomically, one round trip per limit check, keys that expire) against a real redis-server."""
from __future__ import annotations

import asyncio
import uuid

from redis import asyncio as aioredis

from gateway.state import BreakerState, RateLimits, RedisOptions, RedisStore, StateStore, Usage
from tests.support.redis_proc import RedisProc


async def test_session_ttl_expires_and_is_refreshed_by_use(store: StateStore) -> None:
    assert await store.get_session("s") is None
    await store.set_session("s", "http://a:1", ttl_s=0.4)
    assert await store.get_session("s") == "http://a:1"
    for _ in range(3):  # 0.75 s in all, longer than the TTL: every read pushes the expiry out again
        await asyncio.sleep(0.25)
        assert await store.get_session("s") == "http://a:1"
    await asyncio.sleep(0.55)
    assert await store.get_session("s") is None


async def test_session_reassignment_replaces_endpoint(store: StateStore) -> None:
    session = "smollm2\x00agent-7"   # the gateway scopes session keys by model with a NUL
    await store.set_session(session, "http://a:1", ttl_s=30)
    await store.set_session(session, "http://b:2", ttl_s=30)
    assert await store.get_session(session) == "http://b:2"
    assert await store.get_session("other") is None


async def test_usage_counters_add_up(store: StateStore) -> None:
    assert await store.get_usage("k") == Usage()
    await store.record_usage("k", 100, 64, 7)
    await asyncio.gather(*(store.record_usage("k", 10, 0, 3) for _ in range(5)))
    assert await store.get_usage("k") == Usage(num_requests=6, num_prompt_tokens=150, num_cached_tokens=64,
                                               num_completion_tokens=22)
    assert await store.get_usage("other") == Usage()


async def test_breaker_state_is_shared_with_expiry(store: StateStore) -> None:
    assert await store.get_breaker("http://a:1") is None
    await store.set_breaker("http://a:1", BreakerState.OPEN, ttl_s=0.3)
    assert await store.get_breaker("http://a:1") is BreakerState.OPEN
    await asyncio.sleep(0.4)
    assert await store.get_breaker("http://a:1") is None


async def test_inflight_sums_live_replicas_and_forgets_dead_ones(store: StateStore) -> None:
    await store.publish_inflight("r1", "http://a:1", 100, ttl_s=30)
    await store.publish_inflight("r2", "http://a:1", 40, ttl_s=0.3)
    await store.publish_inflight("r3", "http://b:2", 7, ttl_s=30)
    assert await store.sum_inflight("http://a:1") == 140
    assert await store.sum_inflight("http://a:1", exclude_replica_id="r1") == 40
    await store.publish_inflight("r1", "http://a:1", 60, ttl_s=30)   # republish replaces
    assert await store.sum_inflight("http://a:1") == 100
    await asyncio.sleep(0.4)                                          # r2 stopped publishing: gone
    assert await store.sum_inflight("http://a:1") == 60
    assert await store.sum_inflight("http://b:2") == 7
    assert await store.sum_inflight("http://none:3") == 0


async def test_two_replicas_share_one_limit_atomically(redis_server: RedisProc) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    replicas = [RedisStore(RedisOptions(url=redis_server.url, key_prefix=prefix)) for _ in range(2)]
    limits = RateLimits(5, 1000, window_s=60.0)
    try:
        # 20 concurrent requests spread over both replicas: exactly the limit passes, not limit x replicas.
        decisions = await asyncio.gather(*(replicas[i % 2].rate_limit("team", limits, 10) for i in range(20)))
        assert sum(d.allowed for d in decisions) == 5
        # A settlement made by one replica is seen by the other.
        await replicas[0].charge_tokens("team", 940)   # 50 + 940 = 990 spent
        assert (await replicas[1].rate_limit("team", RateLimits(None, 1000, 60.0), 11)).allowed is False
        assert (await replicas[1].rate_limit("team", RateLimits(None, 1000, 60.0), 10)).allowed is True
    finally:
        for replica in replicas:
            await replica.close()


async def test_rate_limit_is_one_round_trip(redis_server: RedisProc) -> None:
    store = RedisStore(RedisOptions(url=redis_server.url, key_prefix=f"test-{uuid.uuid4().hex[:12]}:"))
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await store.rate_limit("warm", RateLimits(100, 1000), 1)   # loads the script once
        await admin.config_resetstat()
        for _ in range(10):
            await store.rate_limit("k", RateLimits(100, 1000), 5)
        stats = await admin.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): row["calls"] for name, row in stats.items()
                 if not name.startswith(("cmdstat_config", "cmdstat_info"))}
        # One EVALSHA per check; Redis 7 also counts the commands the script itself runs.
        assert calls == {"evalsha": 10, "time": 10, "hmget": 10, "hset": 10, "pexpire": 10}
    finally:
        await store.close()
        await admin.aclose()


async def test_redis_keys_expire_once_full_again(redis_server: RedisProc) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    store = RedisStore(RedisOptions(url=redis_server.url, key_prefix=prefix))
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await store.rate_limit("k", RateLimits(10, None, window_s=2.0), 0)
        ttl_ms = await admin.pttl(f"{prefix}rl:k")
        # 1 of 10 requests missing refills in 0.2 s, kept one more window to settle charges: 2.2 s.
        assert 2000 < ttl_ms <= 2200
        await store.set_session("s", "http://a:1", ttl_s=5)
        assert 4000 < await admin.pttl(f"{prefix}session:s") <= 5000
    finally:
        await store.close()
        await admin.aclose()
