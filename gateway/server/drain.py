"""Graceful shutdown: on SIGTERM the gateway stops admitting requests (503 `shutting_down`, and /ready
turns 503 so a load balancer moves away) while the listener stays open, lets the requests in flight
finish, and only then closes. It tracks requests; it never cancels one.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.server.errors import ShuttingDown

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Answered while draining, so that probes and scrapes see the shutdown instead of a refused connection.
_ALWAYS = frozenset({"/health", "/ready", "/metrics"})


class Drain:
    """Counts the requests in flight and wakes `wait_idle` when the last one ends after `start`."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()

    def start(self) -> None:
        self.draining = True
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every request ended within `timeout_s` (the rest are cancelled by the shutdown)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def middleware(self) -> Middleware:
        @web.middleware
        async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path in _ALWAYS:
                return await handler(request)
            if self.draining:
                raise ShuttingDown("This gateway is shutting down; retry the request (another replica takes it)",
                                   headers={"Retry-After": "1", "Connection": "close"})
            self.num_in_flight += 1
            try:
                return await handler(request)
            finally:
                self.num_in_flight -= 1
                if self.draining and self.num_in_flight == 0:
                    self._idle.set()

        return drain_middleware


DRAIN: web.AppKey[Drain] = web.AppKey("switchyard_drain", Drain)
