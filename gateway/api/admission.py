"""Admission for the generation endpoints: the rate limit charged before dispatch (429 with
Retry-After), and settling the charge and per-key usage once the response is known. Who the caller
is was settled before, by the access middleware.

The counting itself lives in the state store (R); this module only speaks its interface.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Coroutine
from typing import Any


from gateway.auth import ApiKey
from gateway.errors import RateLimited
from gateway.services import Services
from gateway.streaming import StreamUsage

log = logging.getLogger(__name__)


async def charge_rate_limit(services: Services, key: ApiKey | None, num_tokens: int) -> int:
    """Charge one request and `num_tokens` (prompt + expected output); returns the tokens charged."""
    if key is None:
        return 0
    limits = key.limits
    if limits.unlimited:
        return 0
    decision = await services.store.rate_limit(key.key_id, limits, num_tokens)
    if not decision.allowed:
        retry_after = max(1, math.ceil(decision.retry_after_s or 1.0))
        raise RateLimited(f"Rate limit exceeded for key {key.key_id!r}; retry after {retry_after}s",
                          headers={"Retry-After": str(retry_after)})
    return num_tokens


async def settle(services: Services, key: ApiKey | None, charged: int, num_prompt_tokens: int,
                 usage: StreamUsage) -> None:
    """After the response: correct the token charge to the actual count and record usage."""
    key_id = key.key_id if key is not None else None
    if key_id is None:
        return
    num_prompt = usage.num_prompt_tokens if usage.num_prompt_tokens is not None else num_prompt_tokens
    actual = num_prompt + usage.num_output_tokens if usage.num_output_tokens or usage.exact else 0
    if charged and actual != charged:
        await services.store.charge_tokens(key_id, actual - charged)
    if usage.num_output_tokens or usage.exact:
        await services.store.record_usage(key_id, num_prompt, usage.num_cached_tokens, usage.num_output_tokens)


async def settle_now(settling: Coroutine[Any, Any, None]) -> None:
    """Run a settle coroutine inline (the in-process store); a failure is logged like a background one."""
    try:
        await settling
    except Exception as exc:  # the response is already decided: settling must not change it
        log.warning("settling the rate limit failed: %r", exc)
