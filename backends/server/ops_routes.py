"""The operations surface of a worker: /health, /metrics, /load and /kv_events for the gateway."""
from __future__ import annotations

from http import HTTPStatus

from aiohttp import web

from backends.server.app_keys import ENGINE_KEY, METRICS_KEY
from backends.server.errors import invalid_param
from backends.server.openai_routes import json_response

_MAX_KV_EVENTS_PER_CALL = 10_000


async def health(request: web.Request) -> web.Response:
    # The app serves only after the engine started (cleanup_ctx), and stops serving before it shuts down.
    failure = request.app[ENGINE_KEY].failure()
    if failure is not None:   # the gateway's poller stops routing here; the worker needs a restart
        return json_response({"status": "failed", "error": failure}, HTTPStatus.SERVICE_UNAVAILABLE)
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def load(request: web.Request) -> web.Response:
    """The engine's LoadReport as JSON (its dataclass fields, verbatim)."""
    return json_response(request.app[ENGINE_KEY].load_report())


async def kv_events(request: web.Request) -> web.Response:
    """KV events after `since`: {"events": [...], "next": N, "reset": bool}."""
    since = _query_int(request, "since", 0)
    limit = min(_query_int(request, "limit", 1000), _MAX_KV_EVENTS_PER_CALL)
    batch = request.app[ENGINE_KEY].kv_events(since, limit)
    return json_response({"events": batch.events, "next": batch.next_since, "reset": batch.reset})


def _query_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid_param(name, f"`{name}` must be a non-negative integer.") from None
    if value < 0:
        raise invalid_param(name, f"`{name}` must be a non-negative integer.")
    return value
