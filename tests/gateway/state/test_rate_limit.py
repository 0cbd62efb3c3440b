"""The rate-limit table (burst, refill, tokens, debt, retry_after), derived by hand from the token-bucket
rule: MemoryStore, on a clock the test moves, gives exactly those answers; a real Redis, which reads its
own clock, gives exactly what the rule (`bucket`) gives at the times it read, so both answer the same."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import pytest
from redis import asyncio as aioredis

from gateway.state import MemoryStore, RateLimits, RedisStore, StateStore, bucket
from tests.gateway.state.conftest import FakeClock, redis_options
from tests.support.redis_proc import RedisProc


@dataclass(frozen=True)
class Step:
    cost: int                              # tokens asked for (take) or settled (charge)
    allowed: bool | None = None            # expected decision (None for a charge)
    retry_after_s: float = 0.0             # expected, when denied
    remaining_requests: int | None = None  # expected right after the step
    remaining_tokens: int | None = None
    wait_s: float = 0.0                    # this much time passes before the step
    charge: bool = False                   # settle with charge_tokens instead of asking
    key_id: str = "k1"


CASES = {
    "request burst, then refill": (RateLimits(3, None, window_s=1.0), [
        Step(0, True, remaining_requests=2),
        Step(0, True, remaining_requests=1),
        Step(0, True, remaining_requests=0),
        Step(0, False, retry_after_s=1 / 3, remaining_requests=0),
        Step(0, True, remaining_requests=0, wait_s=0.36),
        Step(0, False, retry_after_s=(1 - 0.08) / 3, remaining_requests=0),  # 0.36 s later: 1.08 refilled
    ]),
    "tokens: estimate charged up front": (RateLimits(None, 100, window_s=1.0), [
        Step(60, True, remaining_tokens=40),
        Step(60, False, retry_after_s=0.2, remaining_tokens=40),
        Step(40, True, remaining_tokens=0),
        Step(1, False, retry_after_s=0.01, remaining_tokens=0),
        Step(20, True, remaining_tokens=5, wait_s=0.25),
    ]),
    "a cost above the limit passes when full and leaves debt": (RateLimits(None, 100, window_s=1.0), [
        Step(250, True, remaining_tokens=0),
        Step(1, False, retry_after_s=1.51, remaining_tokens=0),
    ]),
    "settling: debt makes later requests wait, refunds give room": (RateLimits(None, 100, window_s=1.0), [
        Step(10, True, remaining_tokens=90),
        Step(190, charge=True),                       # actual was 200: level -100
        Step(10, False, retry_after_s=1.1, remaining_tokens=0),
        Step(-150, charge=True),                      # refund: level 50
        Step(10, True, remaining_tokens=40),
        Step(-1000, charge=True),                     # a refund never overfills the bucket
        Step(100, True, remaining_tokens=0),
        Step(1, False, retry_after_s=0.01, remaining_tokens=0),
    ]),
    "both limits: the request bucket denies": (RateLimits(2, 1000, window_s=1.0), [
        Step(10, True, remaining_requests=1, remaining_tokens=990),
        Step(10, True, remaining_requests=0, remaining_tokens=980),
        Step(10, False, retry_after_s=0.5, remaining_requests=0, remaining_tokens=980),
    ]),
    "both limits: a token denial takes no request": (RateLimits(5, 10, window_s=1.0), [
        Step(10, True, remaining_requests=4, remaining_tokens=0),
        Step(5, False, retry_after_s=0.5, remaining_requests=4, remaining_tokens=0),
        Step(0, True, remaining_requests=3, remaining_tokens=0),
    ]),
    "keys have separate buckets": (RateLimits(1, None, window_s=60.0), [
        Step(0, True, remaining_requests=0),
        Step(0, False, retry_after_s=60.0, remaining_requests=0),
        Step(0, True, remaining_requests=0, key_id="k2"),
    ]),
    "no limits: always allowed, nothing counted": (RateLimits(None, None), [
        Step(10**9, True), Step(10**9, True), Step(10**9, True),
    ]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
async def test_rate_limit_table(case: str) -> None:
    limits, steps = CASES[case]
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    for i, step in enumerate(steps):
        where = f"step {i}: {step}"
        await clock.advance(step.wait_s)
        if step.charge:
            await store.charge_tokens(step.key_id, step.cost)
            continue
        got = await store.rate_limit(step.key_id, limits, step.cost)
        assert got.allowed is step.allowed, where
        assert got.retry_after_s == pytest.approx(step.retry_after_s, abs=1e-9), (where, got)
        assert (got.remaining_requests, got.remaining_tokens) == (step.remaining_requests, step.remaining_tokens), \
            (where, got)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
async def test_redis_answers_as_the_bucket_rule(redis_server: RedisProc, case: str) -> None:
    """The same steps on Redis, with real waits: each answer is exactly what `bucket` computes from the
    levels Redis held before the step, at the time Redis read (its Lua script stores both per key)."""
    limits, steps = CASES[case]
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    store = RedisStore(redis_options(redis_server.url, prefix))
    admin = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        for i, step in enumerate(steps):
            where = f"step {i}: {step}"
            key = f"{prefix}rl:{step.key_id}"
            before = await _stored(admin, key)
            await asyncio.sleep(step.wait_s)
            if step.charge:
                await store.charge_tokens(step.key_id, step.cost)
            else:
                got = await store.rate_limit(step.key_id, limits, step.cost)
            after = await _stored(admin, key)
            if limits.unlimited:
                assert got.allowed and after is None, where  # nothing counted
                continue
            assert after is not None and (before is not None or not step.charge), where
            levels_before = None if before is None else before[0]
            levels_after, now_s = after
            if step.charge:
                want_levels = bucket.charge(levels_before, limits, step.cost, now_s)
            else:
                want_levels, want = bucket.take(levels_before, limits, step.cost, now_s)
                assert got == want, where
            assert (levels_after.num_requests, levels_after.num_tokens) == \
                (want_levels.num_requests, want_levels.num_tokens), where
    finally:
        await store.close()
        await admin.aclose()


async def _stored(admin: aioredis.Redis, key: str) -> tuple[bucket.Levels, float] | None:
    """What the Lua script stored for a key (None: nothing yet): the levels as its next call reads them,
    and the clock reading its last call computed with."""
    fields = await admin.hgetall(key)
    if not fields:
        return None
    levels = bucket.Levels(float(fields["r"]), float(fields["k"]), float(fields["at"]))
    # `at` is TIME's seconds and microseconds written as "%.6f": combined as the script combines
    # them, they give the very float the script computed with.
    seconds, micros = fields["at"].split(".")
    return levels, int(seconds) + int(micros) / 1000000


async def test_waiting_retry_after_is_enough(clocked_store) -> None:
    store, wait = clocked_store
    limits = RateLimits(2, 50, window_s=0.5)
    assert (await store.rate_limit("k", limits, 50)).allowed
    denied = await store.rate_limit("k", limits, 30)
    assert not denied.allowed and denied.retry_after_s > 0.2
    await wait(denied.retry_after_s)
    assert (await store.rate_limit("k", limits, 30)).allowed


async def test_reset_times_report_until_full(store: StateStore) -> None:
    limits = RateLimits(4, 100, window_s=10.0)
    got = await store.rate_limit("k", limits, 25)
    assert got.reset_requests_s == pytest.approx(2.5, abs=0.05)   # 1 of 4 missing, refill 0.4/s
    assert got.reset_tokens_s == pytest.approx(2.5, abs=0.05)     # 25 of 100 missing, refill 10/s


async def test_negative_cost_is_a_programming_error(store: StateStore) -> None:
    with pytest.raises(ValueError):
        await store.rate_limit("k", RateLimits(1, 1), -1)
