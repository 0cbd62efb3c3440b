"""The retries of gateway/upstream/dispatch.py: the retry budget and the retrier (the end-to-end fallback is in
test_fallback.py)."""
from __future__ import annotations

import asyncio

import pytest

from gateway.config.gateway_config import RetryConfig
from gateway.upstream.dispatch import Retrier, RetryBudget
from gateway.upstream.request import RetryableFailure
from tests.support.clock import ManualClock


def test_retry_budget_caps_retries_by_ratio_and_minimum() -> None:
    clock = ManualClock()
    budget = RetryBudget(RetryConfig(budget_ratio=0.2, budget_min_retries=2, budget_window_s=10), clock)
    for _ in range(10):
        budget.on_request()
    assert sum(budget.try_spend() for _ in range(10)) == 4  # 2 + 0.2 x 10
    clock.now += 11  # the window slides past everything
    assert sum(budget.try_spend() for _ in range(10)) == 2


def test_retrier_retries_then_gives_up_with_the_last_failure() -> None:
    config = RetryConfig(max_attempts=3, backoff_initial_s=0.001, backoff_max_s=0.001, backoff_jitter_s=0)
    retrier = Retrier(config, RetryBudget(config))
    calls: list[int] = []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RetryableFailure(f"fail {len(calls)}")
        return "ok"

    assert asyncio.run(retrier.run(attempt)) == "ok" and len(calls) == 3

    async def always() -> str:
        calls.append(1)
        raise RetryableFailure(f"fail {len(calls)}")

    calls.clear()
    with pytest.raises(RetryableFailure, match="fail 3"):
        asyncio.run(retrier.run(always))
