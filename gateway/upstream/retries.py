"""Retries before the first byte: tenacity backoff with jitter, a retry budget.

A retry never goes back to an endpoint this request tried, so an upstream's Retry-After does not delay it:
the endpoint that sent one is held off for new requests instead (legs.py, `CircuitBreaker.hold_off`).

The first attempt runs without tenacity (the hot path pays nothing); only after a retryable failure
does a tenacity loop take over. Choosing *where* the next attempt goes is the dispatcher's job.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, stop_any
from tenacity.stop import stop_base
from tenacity.wait import wait_exponential_jitter

from gateway.config.gateway_config import RetryConfig

T = TypeVar("T")


class RetryableFailure(Exception):
    """An upstream leg failed before any byte reached the client: another endpoint may be tried."""

    def __init__(self, description: str, *, retry_after_s: float | None = None, rate_limited: bool = False) -> None:
        super().__init__(description)
        self.description = description
        self.retry_after_s = retry_after_s
        self.rate_limited = rate_limited    # the upstream answered 429


class RetryBudget:
    """Retries may be at most `ratio` x requests (+ a minimum) over a sliding window, so retries
    cannot multiply an outage. Per-second buckets; the clock is injectable for tests."""

    def __init__(self, config: RetryConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._ratio = config.budget_ratio
        self._min = config.budget_min_retries
        self._num_buckets = max(1, int(config.budget_window_s))
        self._clock = clock
        self._requests = [0] * self._num_buckets
        self._retries = [0] * self._num_buckets
        self._epoch = int(clock())

    def _advance(self) -> int:
        now = int(self._clock())
        if now - self._epoch >= self._num_buckets:
            self._requests = [0] * self._num_buckets
            self._retries = [0] * self._num_buckets
        else:
            for second in range(self._epoch + 1, now + 1):
                self._requests[second % self._num_buckets] = 0
                self._retries[second % self._num_buckets] = 0
        self._epoch = max(self._epoch, now)
        return now % self._num_buckets

    def on_request(self) -> None:
        self._requests[self._advance()] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        index = self._advance()
        if sum(self._retries) >= self._min + self._ratio * sum(self._requests):
            return False
        self._retries[index] += 1
        return True


class _StopWhenBudgetSpent(stop_base):
    """Stops retrying when the budget refuses one more retry (each call spends one if it can)."""

    def __init__(self, budget: RetryBudget) -> None:
        self._budget = budget

    def __call__(self, retry_state: RetryCallState) -> bool:
        return not self._budget.try_spend()


class Retrier:
    """Runs an attempt function until it succeeds, the attempts or the budget run out."""

    def __init__(self, config: RetryConfig, budget: RetryBudget) -> None:
        self._budget = budget
        self._template = AsyncRetrying(
            stop=stop_any(stop_after_attempt(config.max_attempts), _StopWhenBudgetSpent(budget)),
            wait=wait_exponential_jitter(max=config.backoff_max_s, jitter=config.backoff_jitter_s,
                                         multiplier=config.backoff_initial_s),
            retry=retry_if_exception_type(RetryableFailure),
            sleep=asyncio.sleep,
            reraise=True,
        )

    def try_spend(self) -> bool:
        """Take one retry from the budget outside `run` (a stream continued after its upstream failed)."""
        return self._budget.try_spend()

    async def run(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Raises the last RetryableFailure when every allowed attempt failed."""
        self._budget.on_request()
        try:
            return await attempt()
        except RetryableFailure as failure:
            first: list[RetryableFailure] = [failure]

        async def replay_then_attempt() -> T:
            # tenacity sees the fast-path failure as its attempt 1, so counts and waits stay right.
            if first:
                raise first.pop()
            return await attempt()

        return await self._template.copy()(replay_then_attempt)
