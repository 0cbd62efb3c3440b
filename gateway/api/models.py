"""GET /v1/models and GET /v1/models/{model}: the model names clients may send (the configured aliases, not
upstream names)."""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gateway.errors import NotFound
from gateway.services import SERVICES


async def list_models(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    data = [_model(name) for name in services.config.models]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    """One model, as the OpenAI SDK's `models.retrieve` asks for it (a name may hold slashes)."""
    name = request.match_info["model"]
    if name not in request.app[SERVICES].config.models:
        raise NotFound(f"The model {name!r} does not exist", param="model", code="model_not_found")
    return web.Response(body=orjson.dumps(_model(name)), content_type="application/json")


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "switchyard"}
