"""Cross-origin requests from browsers (`cors` in the config; off unless it names origins): a preflight
`OPTIONS` is answered here, before authentication (browsers send it without credentials), and every answer to
an allowed origin carries `Access-Control-Allow-Origin` and the headers a page may read (the request id, the
rate limits, the response cache's result). An origin not allowed gets no CORS header, so the browser keeps the
answer from the page; its preflight is a 403.

The outermost middleware: refusals (401, 429...) carry the headers too, so a page can read why. A stream's
headers leave before its handler returns; it takes them from the request (`CORS_HEADERS`) when it starts.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.config.gateway_config import CorsConfig

CORS_HEADERS: web.RequestKey[dict[str, str]] = web.RequestKey("switchyard_cors_headers", dict)
_EXPOSED = ("x-request-id, x-switchyard-cache, retry-after, x-ratelimit-limit-requests, x-ratelimit-limit-tokens, "
            "x-ratelimit-remaining-requests, x-ratelimit-remaining-tokens, x-ratelimit-reset-requests, "
            "x-ratelimit-reset-tokens")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_cors_middleware(config: CorsConfig) -> Any:
    origins = frozenset(config.allow_origins)
    any_origin = "*" in origins

    def allowed(origin: str | None) -> dict[str, str] | None:
        if origin is None or not (any_origin or origin in origins):
            return None
        if any_origin:
            return {"Access-Control-Allow-Origin": "*", "Access-Control-Expose-Headers": _EXPOSED}
        return {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": _EXPOSED, "Vary": "Origin"}

    @web.middleware
    async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            headers = allowed(origin)
            if headers is None:
                return web.Response(status=403, text="CORS: this origin is not allowed")
            return web.Response(status=204, headers={
                **headers, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ""),
                "Access-Control-Max-Age": str(config.max_age_s)})
        headers = allowed(origin)
        if headers is None:
            return await handler(request)
        request[CORS_HEADERS] = headers
        response = await handler(request)
        if not response.prepared:
            response.headers.update(headers)
        return response

    return cors_middleware
