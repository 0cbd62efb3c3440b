"""GET /v1/usage: per-key token usage. A key reads its own; an admin key may pass `?key_id=` for any."""
from __future__ import annotations

import dataclasses

import orjson
from aiohttp import web

from gateway.access import caller_key
from gateway.errors import BadRequest, Forbidden
from gateway.services import SERVICES


async def get_usage(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    key = caller_key(request)
    if key is None:
        raise BadRequest("usage is tracked per API key and no keys are configured")
    key_id = request.query.get("key_id", key.key_id)
    if key_id != key.key_id and not key.admin:
        raise Forbidden("only an admin key may read another key's usage", param="key_id")
    usage = await services.store.get_usage(key_id)
    body = {"object": "usage", "key_id": key_id, **dataclasses.asdict(usage)}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
