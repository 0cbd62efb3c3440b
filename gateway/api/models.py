"""GET /v1/models: the model names clients may send (the configured aliases, not upstream names)."""
from __future__ import annotations

import orjson
from aiohttp import web

from gateway.services import SERVICES


async def list_models(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "switchyard"}
            for name in services.config.models]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")
