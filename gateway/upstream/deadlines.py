"""Coarse deadlines for the upstream legs (first byte, whole leg, quiet gaps) on one loop timer: arming one is a
dict entry, not a timer of its own, which with its cancel cost as much as the rest of a leg's bookkeeping. A
deadline fires up to `RESOLUTION_S` late, which timeouts of seconds do not notice.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import TracebackType

log = logging.getLogger(__name__)

RESOLUTION_S = 0.05


class Deadlines:
    """Callbacks due at `time.monotonic()` instants; one timer, set for the earliest, serves them all."""

    __slots__ = ("_entries", "_next_key", "_timer", "_timer_at_s")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[float, Callable[[], None]]] = {}
        self._next_key = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s = 0.0

    def add(self, at_s: float, callback: Callable[[], None]) -> int:
        """Run `callback` at `at_s` unless `discard`ed first; the key to discard it with."""
        key = self._next_key
        self._next_key = key + 1
        self._entries[key] = (at_s, callback)
        if self._timer is None or at_s + RESOLUTION_S < self._timer_at_s:
            self._arm(at_s)
        return key

    def discard(self, key: int) -> None:
        self._entries.pop(key, None)

    def timeout(self, delay_s: float | None) -> TaskDeadline:
        """`async with deadlines.timeout(s)`: asyncio.timeout(s) on this sweep."""
        return TaskDeadline(self, delay_s)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._entries.clear()

    def _arm(self, at_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        now_s = time.monotonic()
        delay_s = max(RESOLUTION_S, at_s - now_s)
        self._timer_at_s = now_s + delay_s
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._sweep)

    def _sweep(self) -> None:
        """Run what is due; the timer follows the earliest deadline left (a discarded one that set it costs
        one early sweep)."""
        self._timer = None
        now_s = time.monotonic()
        due = [key for key, (at_s, _) in self._entries.items() if at_s <= now_s]
        for key in due:
            entry = self._entries.pop(key, None)
            if entry is None:
                continue
            try:
                entry[1]()
            except Exception:
                log.exception("a deadline's callback failed")
        if self._entries:
            self._arm(min(at_s for at_s, _ in self._entries.values()))


class TaskDeadline:
    """asyncio.timeout(delay) on a `Deadlines` sweep: at the deadline the task is cancelled and the block
    raises TimeoutError. `reschedule(None)` disarms it (the first body bytes came), the one form legs use."""

    __slots__ = ("_cancelling", "_deadlines", "_delay_s", "_key", "_task", "expired")

    def __init__(self, deadlines: Deadlines, delay_s: float | None) -> None:
        self._deadlines = deadlines
        self._delay_s = delay_s
        self._key: int | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False

    async def __aenter__(self) -> TaskDeadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a TaskDeadline must be used inside a task")
        self._task, self._cancelling = task, task.cancelling()
        if self._delay_s is not None:
            self._key = self._deadlines.add(time.monotonic() + self._delay_s, self._expire)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._key is not None:
            self._deadlines.discard(self._key)
            self._key = None
        # As asyncio.Timeout: only a cancellation this deadline made (none pending besides) becomes a timeout.
        if self.expired and self._task is not None and self._task.uncancel() <= self._cancelling \
                and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def reschedule(self, when: float | None) -> None:
        if when is not None:
            raise ValueError("a TaskDeadline can only be disarmed (reschedule(None))")
        if self._key is not None:
            self._deadlines.discard(self._key)
            self._key = None

    def _expire(self) -> None:
        self._key = None
        self.expired = True
        assert self._task is not None
        self._task.cancel()
