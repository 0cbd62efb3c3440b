"""gateway/upstream/deadlines.py on a real event loop: deadlines fire in their order and never once discarded; a
TaskDeadline behaves as asyncio.timeout does for the legs (TimeoutError at the deadline, disarmed by
reschedule(None), an outside cancellation left a cancellation). Every wait ends on an event, not a sleep."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway.upstream.deadlines import Deadlines

TIMEOUT_S = 30.0   # bounds a broken run only


async def test_deadlines_fire_in_order_and_discarded_ones_never() -> None:
    deadlines = Deadlines()
    fired: list[str] = []
    last = asyncio.Event()
    now_s = time.monotonic()
    deadlines.add(now_s + 0.3, lambda: (fired.append("late"), last.set()))
    discarded = deadlines.add(now_s + 0.1, lambda: fired.append("discarded"))
    deadlines.add(now_s + 0.2, lambda: fired.append("middle"))
    deadlines.add(now_s + 0.1, lambda: fired.append("early"))    # earlier than the timer set so far: re-arms it
    deadlines.discard(discarded)
    await asyncio.wait_for(last.wait(), TIMEOUT_S)
    assert fired == ["early", "middle", "late"]
    deadlines.close()


async def test_a_failing_callback_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    deadlines = Deadlines()
    done = asyncio.Event()
    now_s = time.monotonic()

    def boom() -> None:
        raise RuntimeError("a bug")
    deadlines.add(now_s, boom)
    deadlines.add(now_s, done.set)
    await asyncio.wait_for(done.wait(), TIMEOUT_S)
    assert "a deadline's callback failed" in caplog.text
    deadlines.close()


async def test_task_deadline_raises_timeout_error_at_its_deadline() -> None:
    deadlines = Deadlines()
    never = asyncio.Event()
    with pytest.raises(TimeoutError):
        async with deadlines.timeout(0.05) as deadline:
            await asyncio.wait_for(never.wait(), TIMEOUT_S)
    assert deadline.expired
    assert asyncio.current_task().cancelling() == 0   # the deadline's own cancellation was taken back
    deadlines.close()


async def test_a_disarmed_task_deadline_lets_the_block_run_past_it() -> None:
    deadlines = Deadlines()
    later = asyncio.Event()
    async with deadlines.timeout(0.05) as deadline:
        deadline.reschedule(None)
        deadlines.add(time.monotonic() + 0.2, later.set)    # fires after the disarmed deadline would have
        await asyncio.wait_for(later.wait(), TIMEOUT_S)
    assert not deadline.expired
    with pytest.raises(ValueError):
        deadline.reschedule(time.monotonic())
    deadlines.close()


async def test_an_outside_cancellation_stays_a_cancellation() -> None:
    deadlines = Deadlines()
    entered, never = asyncio.Event(), asyncio.Event()

    async def guarded() -> None:
        async with deadlines.timeout(TIMEOUT_S):
            entered.set()
            await never.wait()
    task = asyncio.create_task(guarded())
    await asyncio.wait_for(entered.wait(), TIMEOUT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadlines.close()


async def test_no_deadline_means_none() -> None:
    deadlines = Deadlines()
    async with deadlines.timeout(None) as deadline:
        await asyncio.sleep(0)
    assert not deadline.expired
    deadlines.close()
