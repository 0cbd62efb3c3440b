"""The worker's optional API key (`--api-key`, or the SWITCHYARD_WORKER_API_KEY environment variable): with one,
every route but the operational read-outs asks for `Authorization: Bearer <key>` and answers 401 in OpenAI's
error shape without it. vLLM's `--api-key` guards `/v1` alone; here `/load`, `/kv_events` (block hashes of what
clients sent: a prefix-cache probe) and `/kv_holds/release` too. The gateway sends a provider's `api_key` on
requests, legs and its pollers alike. The KV-transfer listener has a key of its own, which gateways never hold
(`--kv-key`, backends/kv_transfer/auth.py)."""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.typedefs import Middleware

from backends.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/status", "/status.json"})
ENV_VAR = "SWITCHYARD_WORKER_API_KEY"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(api_key: str) -> Middleware:
    """Refuse requests without the key (inside the error middleware, which renders the 401)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                raise APIError("Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                               status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key")
        return await handler(request)

    return check
