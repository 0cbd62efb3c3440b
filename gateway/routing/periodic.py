"""`Periodic`: a background task that runs `share_once` every `interval_s` until stopped. The sharers between
gateway processes (load_share.py, prefix_share.py) are built on it; a failed round (a store outage) is
logged at debug level and the next one comes anyway.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def share_once(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.share_once()
            except Exception as exc:  # noqa: BLE001 - a store outage must not end the sharing for good
                log.debug("%s failed: %r", type(self).__name__, exc)
            await asyncio.sleep(self._interval_s)
