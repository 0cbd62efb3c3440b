"""The middlewares every request passes, outermost first, and the state they keep:

- CORS (`cors` in the config; off unless it names origins): a preflight `OPTIONS` is answered before
  authentication (browsers send it without credentials); every answer to an allowed origin carries
  `Access-Control-Allow-Origin` and the headers a page may read. It is outermost, so refusals (401, 429...)
  carry them too; a stream's headers leave before its handler returns, so it takes them from the request
  (`CORS_HEADERS`) when it starts. An origin not allowed gets no CORS header; its preflight is a 403.
- Errors, the request boundary: the request id in, any `GatewayError` (gateway/errors.py) out as OpenAI-style
  JSON (or the shape a route of another API renders), unexpected errors logged. aiohttp's own protocol
  errors are answered in the same JSON (`answer_protocol_errors_in_json`).
- Drain, graceful shutdown: on SIGTERM new requests get 503 `shutting_down` (and /ready turns 503 so a load
  balancer moves away) while the listener stays open and the requests in flight finish. It never cancels one.
- Access, who may call what: with keys configured every route needs one except the probes, the status
  page's static HTML (it holds no data; its script asks for a key) and, when the config says so, `/metrics`
  and `/status.json` (otherwise admin-only). It caps each key's generation requests in flight on this
  replica. The keys can be replaced while it runs (`Keys.auth`: SIGHUP reloads them). It decides access
  only; rate limits and usage stay with admission (they need the request's tokens).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from types import MappingProxyType
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from gateway.config.gateway_config import CorsConfig, LimitsConfig
from gateway.errors import (
    BadRequest,
    Forbidden,
    GatewayError,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ShuttingDown,
    Unauthorized,
    error_response,
)
from gateway.server.key_auth import ApiKey, Authenticator
from gateway.telemetry.tracing import REQUEST_ID_HEADER, RequestIds, request_id_var

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- CORS -------------------------------------------------------------------------------------------------

CORS_HEADERS: web.RequestKey[dict[str, str]] = web.RequestKey("switchyard_cors_headers", dict)
_EXPOSED = ("x-request-id, x-switchyard-cache, retry-after, x-ratelimit-limit-requests, x-ratelimit-limit-tokens, "
            "x-ratelimit-remaining-requests, x-ratelimit-remaining-tokens, x-ratelimit-reset-requests, "
            "x-ratelimit-reset-tokens")

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


# --- errors -----------------------------------------------------------------------------------------------

_HTTP_TO_ERROR: dict[int, type[GatewayError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 408: RequestTimeout, 413: PayloadTooLarge,
    429: RateLimited,
}


def _from_http_exception(exc: web.HTTPException) -> GatewayError:
    cls = _HTTP_TO_ERROR.get(exc.status, GatewayError)
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    error = cls(message or exc.reason)
    if cls is GatewayError:
        error.status = exc.status
        error.error_type = "invalid_request_error" if exc.status < 500 else "server_error"
        error.code = exc.reason.lower().replace(" ", "_")
    return error


class _JsonErrorsHandler(RequestHandler):
    """aiohttp's connection protocol, answering what its HTTP parser refuses (a malformed head, a header
    over the limits) with an OpenAI-style error rather than plain text; no middleware runs for these."""
    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)   # logs it; raises if a response already began
        if status >= 500:
            error = GatewayError("internal gateway error", code="internal_error")
        else:
            error = _HTTP_TO_ERROR.get(status, BadRequest)(message or HTTPStatus(status).phrase)
        error.status = status
        response = error_response(error)
        response.force_close()
        return response


class _JsonErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorsHandler(self, loop=self._loop, **self._kwargs)


def answer_protocol_errors_in_json(runner: web.AppRunner) -> None:
    """After `runner.setup()`: every connection of this runner's server answers HTTP protocol errors with
    an OpenAI-style JSON error (aiohttp writes plain text)."""
    server = runner.server
    if type(server) is not web.Server:
        raise TypeError(f"expected aiohttp's own web.Server, got {type(server)!r}")
    server.__class__ = _JsonErrorsServer


# Renders an error as a response; a route of another API (POST /v1/messages) has its own shape.
ErrorRenderer = Callable[[GatewayError], web.Response]


def make_error_middleware(request_ids: RequestIds,
                          renderers: Mapping[str, ErrorRenderer] = MappingProxyType({})) -> Middleware:
    """The request boundary: request id in, OpenAI-style errors out (or the shape `renderers` gives
    the request's path), unexpected errors logged."""

    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER) or request_ids.new()
        return await _handle(request, handler, request_id, renderers)

    return error_middleware


async def _handle(request: web.Request, handler: Handler, request_id: str,
                  renderers: Mapping[str, ErrorRenderer]) -> web.StreamResponse:
    token = request_id_var.set(request_id)
    try:
        try:
            response = await handler(request)
        except GatewayError as exc:
            response = renderers.get(request.path, error_response)(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = renderers.get(request.path, error_response)(_from_http_exception(exc))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            error = GatewayError("internal gateway error", code="internal_error")
            response = renderers.get(request.path, error_response)(error)
        if not response.prepared:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response
    finally:
        request_id_var.reset(token)


# --- drain ------------------------------------------------------------------------------------------------

# Answered while draining, so that probes and scrapes see the shutdown instead of a refused connection.
_ALWAYS = frozenset({"/health", "/ready", "/metrics"})


class Drain:
    """Counts the requests in flight and wakes `wait_idle` when the last one ends after `start`."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()

    def start(self) -> None:
        self.draining = True
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every request ended within `timeout_s` (the rest are cancelled by the shutdown)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def middleware(self) -> Middleware:
        @web.middleware
        async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path in _ALWAYS:
                return await handler(request)
            if self.draining:
                raise ShuttingDown("This gateway is shutting down; retry the request (another replica takes it)",
                                   headers={"Retry-After": "1", "Connection": "close"})
            self.num_in_flight += 1
            try:
                return await handler(request)
            finally:
                self.num_in_flight -= 1
                if self.draining and self.num_in_flight == 0:
                    self._idle.set()

        return drain_middleware


DRAIN: web.AppKey[Drain] = web.AppKey("switchyard_drain", Drain)


# --- access -----------------------------------------------------------------------------------------------

API_KEY: web.RequestKey[ApiKey] = web.RequestKey("switchyard_api_key", ApiKey)

PROBES = frozenset({"/health", "/ready"})
STATUS_PAGE = "/status"
ADMIN = frozenset({"/metrics", "/status.json"})   # what a scrape or the status page reads
GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
                        "/v1/responses"})   # what `max_concurrent_requests` counts: the routes sent upstream

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
