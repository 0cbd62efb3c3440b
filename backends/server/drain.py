"""A worker's graceful shutdown: on SIGTERM it answers new generation requests with 503
`shutting_down` and /health with 503 (the gateway's poller stops routing to it) while the listener
stays open; the requests in flight finish, blocks held for a decode worker are pulled or expire, and
only then does the server close. It never cancels a request itself. The app's `Drain` middleware
(backends/server/app.py) counts the requests in flight and turns new ones away.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from backends.server.app import DRAIN
from backends.server.app_keys import ENGINE_KEY
from backends.server.protocol_errors import answer_protocol_errors_in_json

log = logging.getLogger(__name__)

_POLL_S = 0.05


async def serve(app: web.Application, host: str, port: int, drain_timeout_s: float) -> None:
    """Serve until SIGTERM or SIGINT, then drain for at most `drain_timeout_s` and close."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    answer_protocol_errors_in_json(runner)
    await web.TCPSite(runner, host, port).start()
    log.info("serving on http://%s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        drain = app[DRAIN]
        drain.draining = True
        log.info("draining: %d requests in flight", drain.num_in_flight)
        deadline = time.monotonic() + drain_timeout_s
        # Polled: held blocks are released by decode workers' pulls and by expiry timers, not by an
        # event this loop could wait on, and a shutdown can afford 50 ms.
        while not _idle(app) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        if not _idle(app):
            log.warning("drain timeout after %.0f s: %d requests cut", drain_timeout_s, drain.num_in_flight)
    finally:
        await runner.cleanup()


def _idle(app: web.Application) -> bool:
    """No request in flight and no block held for a decode worker's pull."""
    if app[DRAIN].num_in_flight:
        return False
    engine = app.get(ENGINE_KEY)
    return engine is None or engine.load_report().num_held_blocks == 0
