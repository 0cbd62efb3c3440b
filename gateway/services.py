"""The runtime parts one gateway app shares among its handlers (built in the running loop by app.py),
the typed AppKey they live under, and the tracked background tasks that outlive a response.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from cache.prefix_index import PrefixIndex
from gateway.config.gateway_config import GatewayConfig, ModelConfig
from gateway.routing.endpoints import UpstreamRegistry
from gateway.routing.load import OutputLengthEstimator
from gateway.routing.response_cache import ResponseCache
from gateway.routing.token_count import TokenCounter
from gateway.state import StateStore
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import Tracing
from gateway.upstream.dispatch import Dispatcher

log = logging.getLogger(__name__)


class BackgroundTasks:
    """Fire-and-forget work (settling limits, recording usage) that is still awaited at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for task in list(self._tasks):
            task.cancel()


@dataclass(frozen=True, slots=True)
class Services:
    config: GatewayConfig                              # the validated config
    dispatcher: Dispatcher                             # upstream legs, fallback, relay
    registry: UpstreamRegistry                         # endpoints, breakers, pollers
    store: StateStore                                  # rate limits, sessions, usage (memory or Redis)
    counter: TokenCounter                              # prompt token counts per model
    estimator: OutputLengthEstimator                   # expected output length per model
    metrics: Metrics                                   # Prometheus registry of this app
    tracing: Tracing                                   # the app's tracer
    background: BackgroundTasks                        # post-response work
    response_cache: ResponseCache | None               # whole answers served again (None: no model's are)
    models_by_name: Mapping[str, ModelConfig]          # every name a client may send (aliases too) to its model
    prefix_index: PrefixIndex                          # KV blocks per endpoint and medium, from events and reports


SERVICES: web.AppKey[Services] = web.AppKey("switchyard_services", Services)
