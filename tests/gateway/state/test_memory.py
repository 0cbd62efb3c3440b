"""MemoryStore keeps memory bounded by what is live: expired entries are swept as writes go on."""
from __future__ import annotations

from gateway.state import BreakerState, MemoryStore, RateLimits
from tests.gateway.state.conftest import FakeClock


async def test_expired_entries_are_swept_by_later_writes() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    for i in range(1000):
        await store.set_session(f"s{i}", "http://a:1", ttl_s=10)
        await store.rate_limit(f"k{i}", RateLimits(5, None, window_s=1.0), 0)
        await store.set_breaker(f"http://e{i}:1", BreakerState.OPEN, ttl_s=10)
        await store.share_inflight(f"r{i}", {"http://e:1": (1, 3, 0)}, ttl_s=10)
    assert store.num_entries() == 4000
    clock.now_s += 60                         # everything above has expired
    for i in range(600):                      # more than one sweep period of writes
        await store.set_session(f"new{i}", "http://b:2", ttl_s=10)
    assert store.num_entries() <= 600
    assert await store.get_session("new599") == "http://b:2"
    assert await store.get_session("s0") is None


async def test_rate_limit_bucket_is_forgotten_only_once_full() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    limits = RateLimits(1, None, window_s=10.0)
    assert (await store.rate_limit("k", limits, 0)).allowed
    clock.now_s += 5
    store.sweep()
    assert not (await store.rate_limit("k", limits, 0)).allowed   # still remembered half-way
    clock.now_s += 100
    store.sweep()
    assert store.num_entries() == 0
    assert (await store.rate_limit("k", limits, 0)).allowed
