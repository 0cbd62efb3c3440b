"""GET /v1/models and GET /v1/models/{model}: the model names clients may send (the configured aliases, not
upstream names), those the caller's key may use (`completions.model_for`, the one lookup of a requested
model)."""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gateway.api.completions import model_for
from gateway.server.middlewares import caller_key
from gateway.services import SERVICES


async def list_models(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    key = caller_key(request)
    data = [_model(name) for name, model in services.models_by_name.items() if key is None or key.may_use(model.name)]
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    """One model, as the OpenAI SDK's `models.retrieve` asks for it (a name may hold slashes)."""
    name = request.match_info["model"]
    model_for(request, name)
    return web.Response(body=orjson.dumps(_model(name)), content_type="application/json")


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "switchyard"}
