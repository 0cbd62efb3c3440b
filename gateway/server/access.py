"""Who may call what: the API-key middleware. With keys configured, every route needs one except the
probes (`/health`, `/ready`), the status page's static HTML (`/status`: it holds no data; its script asks
for a key) and, when the config says so, `/metrics` and `/status.json`; these two otherwise need an admin
key. It also caps each key's generation requests in flight on this replica. The keys themselves can be
replaced while it runs (`Keys.auth`: `switchyard gateway` reloads them on SIGHUP).

It decides access only; rate limits and usage stay with admission (they need the request's tokens).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.config.gateway_config import LimitsConfig
from gateway.server.errors import Forbidden, RateLimited, Unauthorized
from gateway.server.key_auth import ApiKey, Authenticator

API_KEY: web.RequestKey[ApiKey] = web.RequestKey("switchyard_api_key", ApiKey)

PROBES = frozenset({"/health", "/ready"})
STATUS_PAGE = "/status"
ADMIN = frozenset({"/metrics", "/status.json"})   # what a scrape or the status page reads
GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
                        "/v1/responses"})   # what `max_concurrent_requests` counts: the routes sent upstream

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def caller_key(request: web.Request) -> ApiKey | None:
    """The authenticated key of this request; None when no keys are configured."""
    return request.get(API_KEY)


class Keys:
    """The keys the middleware checks; `auth` may be replaced at any time (None: authentication off)."""

    __slots__ = ("auth",)

    def __init__(self, auth: Authenticator | None) -> None:
        self.auth = auth


KEYS: web.AppKey[Keys] = web.AppKey("switchyard_keys", Keys)


def make_access_middleware(keys: Keys, limits: LimitsConfig) -> Middleware:
    in_flight: dict[str, int] = {}  # key_id -> generation requests now being served by this app

    @web.middleware
    async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        auth = keys.auth
        if auth is None or path in PROBES or path == STATUS_PAGE or (path in ADMIN and limits.metrics_public):
            return await handler(request)
        key = auth.authenticate(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        if key is None:
            raise Unauthorized("Incorrect or missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
        if path in ADMIN and not key.admin:
            raise Forbidden(f"{path} needs an admin key (or `limits.metrics_public: true`)")
        request[API_KEY] = key
        cap = key.max_concurrent_requests
        if cap is None or path not in GENERATION:
            return await handler(request)
        if in_flight.get(key.key_id, 0) >= cap:
            raise RateLimited(f"Key {key.key_id!r} already has {cap} requests in flight; retry when one ends",
                              code="concurrency_limit_exceeded", headers={"Retry-After": "1"})
        in_flight[key.key_id] = in_flight.get(key.key_id, 0) + 1
        try:
            return await handler(request)
        finally:
            remaining = in_flight[key.key_id] - 1
            if remaining:
                in_flight[key.key_id] = remaining
            else:
                del in_flight[key.key_id]

    return access_middleware
