"""Admission: a request charged to its key's rate limits (per minute) and daily token quota before it is
routed, and the charge settled to what it really used once it ends, with its usage recorded.

Each limit is a token bucket in the state store (gateway/state/bucket.py): the per-minute one under the key's
id, the daily quota under `<key id>\\x00day`, refilling over 24 hours (a rolling day, not a calendar one). The
per-minute bucket's state after the charge goes back to the client in OpenAI's `x-ratelimit-*` headers.
"""
from __future__ import annotations

import logging
import math

from gateway.errors import RateLimited
from gateway.server.client_stream import StreamUsage
from gateway.server.key_auth import ApiKey
from gateway.services import Services
from gateway.state import MemoryStore
from gateway.state.base import RateDecision, RateLimits

log = logging.getLogger(__name__)

DAILY_SUFFIX = "\x00day"


class Charge:
    """What a request was charged: tokens (prompt + expected output) from each bucket named."""

    __slots__ = ("buckets", "headers", "key", "num_tokens")

    def __init__(self, key: ApiKey, num_tokens: int, buckets: tuple[str, ...],
                 headers: dict[str, str] | None = None) -> None:
        self.key = key                   # the caller's key (its usage)
        self.num_tokens = num_tokens     # charged up front to each of `buckets`
        self.buckets = buckets           # the state store's bucket ids charged (none: no limits)
        self.headers = headers           # x-ratelimit-* for the answer (None: no per-minute limit)


async def charge_rate_limit(services: Services, key: ApiKey, num_tokens: int) -> Charge:
    """Charge one request of the caller's `key` and `num_tokens` (prompt + expected output); a request without a
    key (none are configured) has nothing to charge and never comes here. The daily quota is asked first: a
    request it refuses never spends the per-minute bucket, and one the per-minute limit refuses is refunded to
    the quota."""
    store, buckets = services.store, []
    daily = key.daily_limits
    if daily is not None:
        decision = await store.rate_limit(key.key_id + DAILY_SUFFIX, daily, num_tokens)
        if not decision.allowed:
            retry_after = _retry_after(decision)
            raise RateLimited(f"Daily token quota of {daily.max_tokens_per_window} exceeded for key "
                              f"{key.key_id!r}; retry after {retry_after}s", code="insufficient_quota",
                              headers={"Retry-After": str(retry_after)})
        buckets.append(key.key_id + DAILY_SUFFIX)
    limits = key.limits
    if not limits.unlimited:
        decision = await store.rate_limit(key.key_id, limits, num_tokens)
        if not decision.allowed:
            if buckets:
                await store.charge_tokens(buckets[0], -num_tokens)
            retry_after = _retry_after(decision)
            raise RateLimited(f"Rate limit exceeded for key {key.key_id!r}; retry after {retry_after}s",
                              headers={"Retry-After": str(retry_after), **rate_limit_headers(limits, decision)})
        buckets.append(key.key_id)
        return Charge(key, num_tokens, tuple(buckets), rate_limit_headers(limits, decision))
    return Charge(key, num_tokens, tuple(buckets))


def rate_limit_headers(limits: RateLimits, decision: RateDecision) -> dict[str, str]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the limits a key has (a reset is a
    duration until the bucket is full again: `"1s"`, `"6m0s"`, `"120ms"`)."""
    headers = {}
    for kind, limit, remaining, reset_s in (
            ("requests", limits.max_requests_per_window, decision.remaining_requests, decision.reset_requests_s),
            ("tokens", limits.max_tokens_per_window, decision.remaining_tokens, decision.reset_tokens_s)):
        if limit is not None and remaining is not None and reset_s is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = _duration(reset_s)
    return headers


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def _retry_after(decision: RateDecision) -> int:
    return max(1, math.ceil(decision.retry_after_s or 1.0))


async def settle(services: Services, charge: Charge, num_prompt_tokens: int, usage: StreamUsage) -> None:
    """After the response (or the error, or the cancellation): correct the charge to what was really
    used and record usage. In-process the store never suspends, so it runs inline (no task); with Redis
    it runs in the background so the response does not wait for it."""
    settling = _settle(services, charge, num_prompt_tokens, usage)
    if not isinstance(services.store, MemoryStore):
        services.background.spawn(settling)
        return
    try:
        await settling
    except Exception as exc:  # noqa: BLE001 - the response is already decided: settling must not change it
        log.warning("settling the rate limit failed: %r", exc)


async def _settle(services: Services, charge: Charge, num_prompt_tokens: int, usage: StreamUsage) -> None:
    num_prompt = usage.prompt_tokens(num_prompt_tokens)
    actual = num_prompt + usage.num_output_tokens if usage.served else 0
    if actual != charge.num_tokens:
        for bucket in charge.buckets:
            await services.store.charge_tokens(bucket, actual - charge.num_tokens)
    if usage.served:
        await services.store.record_usage(charge.key.key_id, num_prompt, usage.num_cached_tokens,
                                          usage.num_output_tokens)
