"""Sessions, usage, breakers and in-flight tokens on both stores; what only Redis does (replicas sharing
one limit atomically, one round trip per limit check, keys that expire) against a real redis-server."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

from redis import asyncio as aioredis

from gateway.state import BreakerState, MemoryStore, RateLimits, RedisStore, StateStore, Usage
from gateway.state.redis_store import session_keys
from tests.gateway.state.conftest import FakeClock, Wait, redis_options
from tests.support.redis_cluster_proc import SharedRedis
from tests.support.redis_proc import RedisProc
from tests.support.wait import await_until


async def test_session_ttl_expires_and_is_refreshed_by_use() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    assert await store.get_session("s") is None
    await store.set_session("s", "http://a:1", ttl_s=0.4)
    assert await store.get_session("s") == "http://a:1"
    for _ in range(3):  # 0.75 s in all, longer than the TTL: every read pushes the expiry out again
        await clock.advance(0.25)
        assert await store.get_session("s") == "http://a:1"
    await clock.advance(0.4)
    assert await store.get_session("s") is None


async def test_redis_session_ttl_expires_and_is_refreshed_by_use(redis_server: RedisProc) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    store = RedisStore(redis_options(redis_server.url, prefix))
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    key = session_keys(prefix, "s")[0]
    try:
        assert await store.get_session("s") is None
        await store.set_session("s", "http://a:1", ttl_s=30)
        await admin.pexpire(key, 1000)                  # as if 29 of its 30 s had passed
        assert await store.get_session("s") == "http://a:1"
        assert await admin.pttl(key) > 1000             # the read pushed the expiry out to 30 s again
        await store.set_session("s", "http://a:1", ttl_s=0.05)

        async def expired() -> bool:                    # EXISTS, not a read: a read would refresh it
            return not await admin.exists(key)

        await await_until(expired, "the session to expire")
        assert await store.get_session("s") is None
    finally:
        await store.close()
        await admin.aclose()


async def test_session_reassignment_replaces_endpoint(store: StateStore) -> None:
    session = "smollm2\x00agent-7"   # the gateway scopes session keys by model with a NUL
    await store.set_session(session, "http://a:1", ttl_s=30)
    await store.set_session(session, "http://b:2", ttl_s=30)
    assert await store.get_session(session) == "http://b:2"
    assert await store.get_session("other") is None


async def test_live_sessions_are_counted_until_they_expire(clocked_store: tuple[StateStore, Wait]) -> None:
    store, wait = clocked_store
    assert await store.count_sessions() == 0
    # Redis's clock is real and a sleep may overrun on a loaded machine: each step has 1.2 s to spare.
    await store.set_session("smollm2\x00a", "http://a:1", ttl_s=3.0)
    await store.set_session("smollm2\x00b", "http://a:1", ttl_s=3.0)
    await store.set_session("smollm2\x00c", "http://b:2", ttl_s=30)
    await store.set_session("smollm2\x00c", "http://a:1", ttl_s=30)     # moved: still one session
    assert await store.count_sessions() == 3
    await wait(1.8)
    assert await store.get_session("smollm2\x00a") == "http://a:1"       # a read keeps `a` alive for 3 s more
    await wait(1.8)                                                       # `b` is 3.6 s old: gone
    assert await store.count_sessions() == 2
    await wait(3.0)
    assert await store.count_sessions() == 1


async def test_usage_counters_add_up(store: StateStore) -> None:
    assert await store.get_usage("k") == Usage()
    await store.record_usage("k", 100, 64, 7)
    await asyncio.gather(*(store.record_usage("k", 10, 0, 3) for _ in range(5)))
    assert await store.get_usage("k") == Usage(num_requests=6, num_prompt_tokens=150, num_cached_tokens=64,
                                               num_completion_tokens=22)
    assert await store.get_usage("other") == Usage()


async def test_breaker_state_is_shared_with_expiry(store: StateStore) -> None:
    assert await store.get_breaker("http://a:1") is None
    await store.set_breaker("http://a:1", BreakerState.OPEN, ttl_s=30)
    assert await store.get_breaker("http://a:1") is BreakerState.OPEN
    await store.set_breaker("http://a:1", BreakerState.OPEN, ttl_s=0.05)  # set again, to expire soon

    async def expired() -> bool:
        return await store.get_breaker("http://a:1") is None

    await await_until(expired, "the breaker state to expire")


async def test_inflight_sums_the_other_live_replicas_and_forgets_dead_ones(store: StateStore) -> None:
    a, b = "http://a:1", "http://b:2"
    assert await store.share_inflight("r1", {a: (1, 100, 10)}, ttl_s=30) == {}
    assert await store.share_inflight("r2", {a: (2, 40, 0), b: (1, 7, 3)}, ttl_s=30) == {a: [1, 100, 10]}
    assert await store.share_inflight("r3", {}, ttl_s=30) == {a: [3, 140, 10], b: [1, 7, 3]}
    assert await store.share_inflight("r1", {a: (1, 60, 10)}, ttl_s=30) == {a: [2, 40, 0], b: [1, 7, 3]}
    assert await store.share_inflight("r3", {}, ttl_s=30) == {a: [3, 100, 10], b: [1, 7, 3]}  # r1's replaced
    await store.share_inflight("r2", {a: (2, 40, 0), b: (1, 7, 3)}, ttl_s=0.05)  # r2's last, then it stops

    async def r2_gone() -> bool:
        return await store.share_inflight("r3", {}, ttl_s=30) == {a: [1, 60, 10]}

    await await_until(r2_gone, "r2's leases to expire")


async def test_a_replica_entry_that_is_not_counts_adds_nothing_on_redis(redis_server: RedisProc) -> None:
    """Another version's (or a damaged) entry in the shared hash is skipped by the script, not fatal."""
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    store = RedisStore(redis_options(redis_server.url, prefix))
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    expires_ms = int(time.time() * 1000) + 60_000
    try:
        await store.share_inflight("r1", {"http://a:1": (1, 10, 2)}, ttl_s=30)
        for field, value in (("old", "not json"), ("array", "[1, 2]"), ("strings", '{"http://a:1": ["x", 5]}'),
                             ("no-expiry", '{"http://a:1": [100, 100, 100]}')):
            await admin.hset(f"{prefix}inflight:replicas", field,
                             value if field == "no-expiry" else f"{expires_ms}|{value}")
        assert await store.share_inflight("r2", {}, ttl_s=30) == {"http://a:1": [1, 15, 2]}
        assert not await admin.hexists(f"{prefix}inflight:replicas", "no-expiry")    # dropped as expired
    finally:
        await admin.aclose()
        await store.close()


async def test_the_routed_log_is_read_in_order_from_a_cursor_and_capped(store: StateStore) -> None:
    assert await store.read_routed("0-0", 10) == ("0-0", [])
    for i in range(5):
        await store.publish_routed(f"r{i % 2}", f"batch {i}", max_entries=1000)
    cursor, first = await store.read_routed("0-0", 3)
    assert first == [("r0", "batch 0"), ("r1", "batch 1"), ("r0", "batch 2")]
    cursor, rest = await store.read_routed(cursor, 3)
    assert rest == [("r1", "batch 3"), ("r0", "batch 4")]
    assert await store.read_routed(cursor, 3) == (cursor, [])          # nothing new: the cursor stays
    await store.publish_routed("r1", "batch 5", max_entries=1000)
    assert (await store.read_routed(cursor, 3))[1] == [("r1", "batch 5")]
    later = f"{time.time_ns() // 1_000_000 + 60_000}-0"                 # a cursor by time: a minute ahead
    assert (await store.read_routed(later, 3))[1] == []
    for i in range(1000):
        await store.publish_routed("r2", f"more {i}", max_entries=100)
    _, kept = await store.read_routed("0-0", 2000)
    assert 100 <= len(kept) < 300 and kept[-1] == ("r2", "more 999")   # Redis trims by whole nodes (~100)


async def test_two_replicas_share_one_limit_atomically(shared_redis: SharedRedis) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    replicas = [RedisStore(redis_options(shared_redis.url, prefix)) for _ in range(2)]
    day_s = 86_400.0   # a day's window: what refills while the test runs (~0.01 token/s) never tips a decision
    limits = RateLimits(5, 1000, window_s=day_s)
    try:
        # 20 concurrent requests spread over both replicas: exactly the limit passes, not limit x replicas.
        decisions = await asyncio.gather(*(replicas[i % 2].rate_limit("team", limits, 10) for i in range(20)))
        assert sum(d.allowed for d in decisions) == 5
        # A settlement made by one replica is seen by the other.
        await replicas[0].charge_tokens("team", 940)   # 50 + 940 = 990 spent
        assert (await replicas[1].rate_limit("team", RateLimits(None, 1000, day_s), 11)).allowed is False
        assert (await replicas[1].rate_limit("team", RateLimits(None, 1000, day_s), 10)).allowed is True
    finally:
        for replica in replicas:
            await replica.close()


async def test_rate_limit_is_one_round_trip(shared_redis: SharedRedis) -> None:
    """On one server and on a cluster (every master's counts together: the cluster client's own topology
    queries happen when it connects, before the counts are reset)."""
    store = RedisStore(redis_options(shared_redis.url, f"test-{uuid.uuid4().hex[:12]}:"))
    servers = shared_redis.cluster.masters() if shared_redis.cluster else [shared_redis.server]
    admins = [aioredis.Redis.from_url(server.url, decode_responses=True) for server in servers if server]
    try:
        await store.rate_limit("k", RateLimits(100, 1000), 1)   # connects, loads the script once
        for admin in admins:
            await admin.config_resetstat()
        for _ in range(10):
            await store.rate_limit("k", RateLimits(100, 1000), 5)
        calls: Counter[str] = Counter()
        for admin in admins:
            stats = await admin.info("commandstats")
            calls.update({name.removeprefix("cmdstat_"): row["calls"] for name, row in stats.items()
                          if not name.startswith(("cmdstat_config", "cmdstat_info", "cmdstat_cluster"))})
        # One EVALSHA per check; Redis 7 also counts the commands the script itself runs.
        assert dict(calls) == {"evalsha": 10, "time": 10, "hmget": 10, "hset": 10, "pexpire": 10}
    finally:
        await store.close()
        for admin in admins:
            await admin.aclose()


async def test_redis_keys_expire_once_full_again(redis_server: RedisProc) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    store = RedisStore(redis_options(redis_server.url, prefix))
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        # A TTL counts down from when it is set: bracket that by the time this test took (not a limit on it).
        started = time.monotonic()
        await store.rate_limit("k", RateLimits(10, None, window_s=2.0), 0)
        ttl_ms = await admin.pttl(f"{prefix}rl:k")
        elapsed_ms = (time.monotonic() - started) * 1000
        # 1 of 10 requests missing refills in 0.2 s, kept one more window to settle charges: 2.2 s.
        assert 2200 - elapsed_ms - 1 <= ttl_ms <= 2201
        started = time.monotonic()
        await store.set_session("s", "http://a:1", ttl_s=5)
        ttl_ms = await admin.pttl(session_keys(prefix, "s")[0])
        elapsed_ms = (time.monotonic() - started) * 1000
        assert 5000 - elapsed_ms - 1 <= ttl_ms <= 5000
    finally:
        await store.close()
        await admin.aclose()
