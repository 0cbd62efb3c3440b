"""Waiting for a condition instead of for time: poll a predicate until it holds, up to a deadline.

The deadline only bounds a broken run; a passing run returns as soon as the condition holds, so
the suite neither depends on the machine's speed nor spends fixed sleeps.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0


def wait_until(predicate: Callable[[], T], what: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               interval_s: float = 0.02) -> T:
    """Call `predicate` until it returns something truthy, and return that; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {value!r})")
        time.sleep(interval_s)


async def await_until(predicate: Callable[[], T | Awaitable[T]], what: str, *,
                      timeout_s: float = DEFAULT_TIMEOUT_S, interval_s: float = 0.02) -> T:
    """The asyncio form: `predicate` may be a plain or an async callable."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {value!r})")
        await asyncio.sleep(interval_s)
