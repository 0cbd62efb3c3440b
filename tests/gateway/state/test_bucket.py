"""Properties of the token-bucket rule (`bucket`), which MemoryStore runs and the Redis Lua mirrors."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gateway.state import RateLimits, bucket

limits_st = st.builds(
    RateLimits,
    st.one_of(st.none(), st.integers(1, 50)),
    st.one_of(st.none(), st.integers(1, 5000)),
    st.floats(0.5, 120.0),
)
# (seconds since the previous step, tokens asked, tokens settled afterwards: actual - estimate)
steps_st = st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 8000), st.integers(-2000, 2000)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(limits_st, steps_st)
def test_admitted_requests_never_exceed_burst_plus_refill(limits: RateLimits, steps: list) -> None:
    now_s, levels, num_admitted = 0.0, None, 0
    for dt_s, cost, settle in steps:
        now_s += dt_s
        levels, result = bucket.take(levels, limits, cost, now_s)
        num_admitted += result.allowed
        if result.allowed and settle:
            levels = bucket.charge(levels, limits, settle, now_s)
        if limits.max_requests_per_window is not None:
            assert levels.num_requests <= limits.max_requests_per_window
            allowance = limits.max_requests_per_window * (1 + now_s / limits.window_s)
            assert num_admitted <= allowance + 1e-6
        if limits.max_tokens_per_window is not None:
            assert levels.num_tokens <= limits.max_tokens_per_window
        if result.remaining_tokens is not None:
            assert result.remaining_tokens >= 0


@settings(max_examples=200, deadline=None)
@given(limits_st, steps_st, st.integers(0, 8000))
def test_retry_after_is_exactly_the_wait(limits: RateLimits, steps: list, cost: int) -> None:
    now_s, levels = 0.0, None
    for dt_s, step_cost, settle in steps:
        now_s += dt_s
        levels, _ = bucket.take(levels, limits, step_cost, now_s)
        levels = bucket.charge(levels, limits, settle, now_s)
    after, result = bucket.take(levels, limits, cost, now_s)
    if result.allowed:
        return
    assert after == bucket.refill(levels, limits, now_s)           # a denial takes nothing
    assert result.retry_after_s > 0
    assert bucket.take(after, limits, cost, now_s + result.retry_after_s * (1 + 1e-9) + 1e-9)[1].allowed
    if result.retry_after_s > 1e-3:
        assert not bucket.take(after, limits, cost, now_s + result.retry_after_s * 0.999)[1].allowed


def test_refill_never_loses_on_a_clock_step_back() -> None:
    limits = RateLimits(10, None, window_s=10.0)
    levels, _ = bucket.take(None, limits, 0, now_s=100.0)
    assert bucket.refill(levels, limits, now_s=50.0).num_requests == levels.num_requests
