"""Operational endpoints: /health (the process is up), /ready (upstreams usable, per config), /metrics."""
from __future__ import annotations

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.config.gateway_config import ReadyRequirement
from gateway.server.middlewares import DRAIN
from gateway.services import SERVICES


async def health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def ready(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    requirement = services.config.ready
    per_model = {name: services.registry.is_ready(model.providers) for name, model in services.config.models.items()}
    if request.app[DRAIN].draining:
        is_ready = False
    elif requirement is ReadyRequirement.NONE:
        is_ready = True
    elif requirement is ReadyRequirement.ANY_MODEL:
        is_ready = any(per_model.values())
    else:
        is_ready = all(per_model.values())
    status = "draining" if request.app[DRAIN].draining else "ready" if is_ready else "not_ready"
    body = {"status": status, "models": per_model}
    return web.Response(status=200 if is_ready else 503, body=orjson.dumps(body), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICES].metrics.render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response
