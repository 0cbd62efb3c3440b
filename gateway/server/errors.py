"""The gateway's error hierarchy and the one middleware that turns errors into OpenAI-style JSON (or, on
a route of another API, that API's shape).

Handlers raise `GatewayError` subclasses; nothing else in the gateway builds an error body.
The middleware is also the request boundary: it sets the request id and logs unexpected errors.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from types import MappingProxyType

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from gateway.telemetry.tracing import REQUEST_ID_HEADER, RequestIds, request_id_var

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """An error with an HTTP status and an OpenAI error `type`/`code`."""
    status: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class BadRequest(GatewayError):
    status, error_type, code = 400, "invalid_request_error", "invalid_request"


class Unauthorized(GatewayError):
    status, error_type, code = 401, "authentication_error", "invalid_api_key"


class Forbidden(GatewayError):
    status, error_type, code = 403, "permission_error", "forbidden"


class NotFound(GatewayError):
    status, error_type, code = 404, "invalid_request_error", "not_found"


class RequestTimeout(GatewayError):
    status, error_type, code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(GatewayError):
    status, error_type, code = 413, "invalid_request_error", "request_too_large"


class RateLimited(GatewayError):
    status, error_type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class UpstreamsFailed(GatewayError):
    """Every endpoint of every provider in the chain failed (or answered with a server error)."""
    status, error_type, code = 502, "upstream_error", "upstream_failed"


class UpstreamsRateLimited(GatewayError):
    """Every endpoint tried answered 429: the client should back off (its Retry-After, when one came)."""
    status, error_type, code = 429, "rate_limit_error", "upstream_rate_limited"


class NoUpstreamAvailable(GatewayError):
    """No endpoint could even be tried (all circuits open, retry budget spent, nothing healthy)."""
    status, error_type, code = 503, "upstream_error", "no_upstream_available"


class ShuttingDown(GatewayError):
    """The replica is draining (SIGTERM): it finishes what it has and takes nothing new."""
    status, error_type, code = 503, "server_error", "shutting_down"


def error_response(error: GatewayError) -> web.Response:
    return web.Response(status=error.status, body=orjson.dumps(error.body()),
                        content_type="application/json", headers=error.headers)


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


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
