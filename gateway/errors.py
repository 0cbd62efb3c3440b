"""The gateway's error hierarchy: handlers and every layer below raise `GatewayError` subclasses, and
nothing else in the gateway builds an error body. The middleware that renders them (OpenAI-style JSON, or
another API's shape on its routes) is `gateway/server/middlewares.py`'s.
"""
from __future__ import annotations

import orjson
from aiohttp import web


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
