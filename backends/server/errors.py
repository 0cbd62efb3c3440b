"""The worker's API errors: one exception type carrying an OpenAI-style error body.

Handlers and parsers raise `APIError`; the error middleware in `app.py` is the only place that
turns exceptions into HTTP responses.
"""
from __future__ import annotations

import enum
from http import HTTPStatus
from typing import Any


class ErrorType(str, enum.Enum):
    INVALID_REQUEST = "invalid_request_error"   # the client sent something we refuse (4xx)
    NOT_FOUND = "not_found_error"               # the route does not exist
    SERVER = "server_error"                     # our fault (5xx)
    UNAVAILABLE = "service_unavailable_error"   # the engine is not (or no longer) serving


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
        error_type: ErrorType = ErrorType.INVALID_REQUEST,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(
    message: str, error_type: ErrorType, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type.value, "param": param, "code": code}}


def invalid_param(param: str, message: str) -> APIError:
    """A 400 naming the offending field, as OpenAI does for out-of-range values."""
    return APIError(message, param=param, code="invalid_value")


def unsupported_param(param: str, message: str) -> APIError:
    """A field this worker cannot honour (OpenAI's code for it): not the request's fault, so the gateway hands the
    request to the next provider of its chain (vLLM, SGLang) where there is one."""
    return APIError(message, param=param, code="unsupported_parameter")


def model_not_found(model: str) -> APIError:
    return APIError(
        f"The model `{model}` does not exist.",
        status=HTTPStatus.NOT_FOUND,
        param="model",
        code="model_not_found",
    )
