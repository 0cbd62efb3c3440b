"""GET /openapi.json: the gateway's OpenAPI description (gateway/openapi.yaml), read once at start-up.

It is public even with api_keys configured (see gateway/server/middlewares.py): it describes the API, not this
deployment, and a client needs it before it holds a key.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

import orjson
import yaml
from aiohttp import web


def load_openapi_json() -> bytes:
    """The packaged YAML document as JSON bytes (package data, so `pip install .` ships it)."""
    text = resources.files("gateway").joinpath("openapi.yaml").read_text(encoding="utf-8")
    return orjson.dumps(yaml.safe_load(text))


def handler() -> Callable[[web.Request], Awaitable[web.Response]]:
    """The GET /openapi.json handler; the document is parsed here, once, when the route table is built."""
    body = load_openapi_json()

    async def get_openapi(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return get_openapi
