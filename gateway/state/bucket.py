"""Token-bucket rate limiting as pure functions: the reference for `redis_scripts.RATE_LIMIT`/`CHARGE`.

Two buckets per key (requests, tokens), each holding up to its limit and refilling linearly so that
it is full again one window after being empty. MemoryStore runs these; the Lua scripts mirror them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.state.base import RateDecision, RateLimits

# Float slack so that waiting exactly `retry_after_s` is enough despite rounding.
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Levels:
    num_requests: float   # requests that may pass now (0 when the request limit is off)
    num_tokens: float     # tokens that may be spent now; negative while in debt (0 when off)
    at_s: float           # the clock reading these levels are valid at


def full(limits: RateLimits, now_s: float) -> Levels:
    return Levels(float(limits.max_requests_per_window or 0), float(limits.max_tokens_per_window or 0), now_s)


def refill(levels: Levels, limits: RateLimits, now_s: float) -> Levels:
    """Levels at `now_s`: each bucket gains limit/window per second up to its limit (never loses on a
    clock step backwards)."""
    elapsed_s = max(0.0, now_s - levels.at_s)
    return Levels(
        _refill_one(levels.num_requests, limits.max_requests_per_window, limits.window_s, elapsed_s),
        _refill_one(levels.num_tokens, limits.max_tokens_per_window, limits.window_s, elapsed_s),
        now_s,
    )


def take(levels: Levels | None, limits: RateLimits, cost_tokens: int, now_s: float) -> tuple[Levels, RateDecision]:
    """Admit one request costing `cost_tokens` if both buckets have room. A cost above the token limit
    passes once the bucket is full and leaves it in debt, so huge requests are slowed, not refused forever."""
    if cost_tokens < 0:
        raise ValueError("cost_tokens must not be negative")
    cur = full(limits, now_s) if levels is None else refill(levels, limits, now_s)
    max_requests, max_tokens = limits.max_requests_per_window, limits.max_tokens_per_window
    wait_requests_s = _wait_s(cur.num_requests, 1, max_requests, limits.window_s)
    wait_tokens_s = _wait_s(cur.num_tokens, min(cost_tokens, max_tokens or 0), max_tokens, limits.window_s)
    allowed = wait_requests_s == 0.0 and wait_tokens_s == 0.0
    if allowed:
        cur = Levels(cur.num_requests - (1 if max_requests else 0),
                     cur.num_tokens - (cost_tokens if max_tokens else 0), now_s)
    return cur, decision(cur, limits, allowed, max(wait_requests_s, wait_tokens_s))


def charge(levels: Levels, limits: RateLimits, num_tokens: int, now_s: float) -> Levels:
    """Take `num_tokens` more from the token bucket (negative refunds, up to the limit)."""
    cur = refill(levels, limits, now_s)
    if limits.max_tokens_per_window is None:
        return cur
    num_left = min(float(limits.max_tokens_per_window), cur.num_tokens - num_tokens)
    return Levels(cur.num_requests, num_left, now_s)


def seconds_until_full(levels: Levels, limits: RateLimits) -> float:
    """How long until both buckets are full (after that the key's state can be forgotten)."""
    return max(_until_full_s(levels.num_requests, limits.max_requests_per_window, limits.window_s),
               _until_full_s(levels.num_tokens, limits.max_tokens_per_window, limits.window_s))


def decision(levels: Levels, limits: RateLimits, allowed: bool, retry_after_s: float) -> RateDecision:
    max_requests, max_tokens = limits.max_requests_per_window, limits.max_tokens_per_window
    return RateDecision(
        allowed=allowed,
        retry_after_s=0.0 if allowed else retry_after_s,
        remaining_requests=None if max_requests is None else max(0, math.floor(levels.num_requests + _EPSILON)),
        remaining_tokens=None if max_tokens is None else max(0, math.floor(levels.num_tokens + _EPSILON)),
        reset_requests_s=None if max_requests is None else _until_full_s(levels.num_requests, max_requests,
                                                                          limits.window_s),
        reset_tokens_s=None if max_tokens is None else _until_full_s(levels.num_tokens, max_tokens, limits.window_s),
    )


def _refill_one(level: float, limit: int | None, window_s: float, elapsed_s: float) -> float:
    if limit is None:
        return 0.0
    return min(float(limit), level + elapsed_s * limit / window_s)


def _wait_s(level: float, need: float, limit: int | None, window_s: float) -> float:
    if limit is None or level >= need - _EPSILON:
        return 0.0
    return (need - level) * window_s / limit


def _until_full_s(level: float, limit: int | None, window_s: float) -> float:
    if limit is None:
        return 0.0
    return max(0.0, (limit - level) * window_s / limit)
