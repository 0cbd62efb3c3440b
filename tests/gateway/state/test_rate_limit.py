"""The rate-limit table (burst, refill, tokens, debt, retry_after), run against MemoryStore and a real
Redis: both must give the same answers, which are derived by hand from the token-bucket rule."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import pytest

from gateway.state import RateLimits, StateStore

# Slack for time that passes between the steps (a loaded 2-core CI box): buckets refill meanwhile,
# so remaining counts may be a little higher and retry_after a little lower than the exact figure.
LAG_S = 0.1


@dataclass(frozen=True)
class Step:
    cost: int                              # tokens asked for (take) or settled (charge)
    allowed: bool | None = None            # expected decision (None for a charge)
    retry_after_s: float = 0.0             # expected, when denied
    remaining_requests: int | None = None  # expected right after the step
    remaining_tokens: int | None = None
    sleep_s: float = 0.0                   # wait this long before the step
    charge: bool = False                   # settle with charge_tokens instead of asking
    key_id: str = "k1"


CASES = {
    "request burst, then refill": (RateLimits(3, None, window_s=1.0), [
        Step(0, True, remaining_requests=2),
        Step(0, True, remaining_requests=1),
        Step(0, True, remaining_requests=0),
        Step(0, False, retry_after_s=1 / 3, remaining_requests=0),
        Step(0, True, remaining_requests=0, sleep_s=0.36),
        Step(0, False, retry_after_s=(1 - 0.08) / 3, remaining_requests=0),  # slept 0.36 s: 1.08 refilled
    ]),
    "tokens: estimate charged up front": (RateLimits(None, 100, window_s=1.0), [
        Step(60, True, remaining_tokens=40),
        Step(60, False, retry_after_s=0.2, remaining_tokens=40),
        Step(40, True, remaining_tokens=0),
        Step(1, False, retry_after_s=0.01, remaining_tokens=0),
        Step(20, True, remaining_tokens=5, sleep_s=0.25),
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
async def test_rate_limit_table(store: StateStore, case: str) -> None:
    limits, steps = CASES[case]
    token_slack = _slack(limits.max_tokens_per_window, limits.window_s)
    request_slack = _slack(limits.max_requests_per_window, limits.window_s)
    for i, step in enumerate(steps):
        where = f"step {i}: {step}"
        if step.sleep_s:
            await asyncio.sleep(step.sleep_s)
        if step.charge:
            await store.charge_tokens(step.key_id, step.cost)
            continue
        got = await store.rate_limit(step.key_id, limits, step.cost)
        assert got.allowed is step.allowed, where
        if step.allowed:
            assert got.retry_after_s == 0.0, where
        else:
            assert step.retry_after_s - LAG_S <= got.retry_after_s <= step.retry_after_s + 1e-6, (where, got)
        _assert_near(got.remaining_requests, step.remaining_requests, request_slack, where)
        _assert_near(got.remaining_tokens, step.remaining_tokens, token_slack, where)


async def test_waiting_retry_after_is_enough(store: StateStore) -> None:
    limits = RateLimits(2, 50, window_s=0.5)
    assert (await store.rate_limit("k", limits, 50)).allowed
    denied = await store.rate_limit("k", limits, 30)
    assert not denied.allowed and denied.retry_after_s > 0.2
    await asyncio.sleep(denied.retry_after_s + 0.01)
    assert (await store.rate_limit("k", limits, 30)).allowed


async def test_reset_times_report_until_full(store: StateStore) -> None:
    limits = RateLimits(4, 100, window_s=10.0)
    got = await store.rate_limit("k", limits, 25)
    assert got.reset_requests_s == pytest.approx(2.5, abs=0.05)   # 1 of 4 missing, refill 0.4/s
    assert got.reset_tokens_s == pytest.approx(2.5, abs=0.05)     # 25 of 100 missing, refill 10/s


async def test_negative_cost_is_a_programming_error(store: StateStore) -> None:
    with pytest.raises(ValueError):
        await store.rate_limit("k", RateLimits(1, 1), -1)


def _slack(limit: int | None, window_s: float) -> int:
    return 0 if limit is None else math.ceil(LAG_S * limit / window_s) + 1


def _assert_near(got: int | None, want: int | None, slack: int, where: str) -> None:
    if want is None:
        assert got is None, where
    else:
        assert got is not None and want <= got <= want + slack, (where, got, want)
