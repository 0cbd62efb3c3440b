"""HTTP protocol errors in the OpenAI envelope: what aiohttp's parser refuses (a malformed request head, a
header over its limits) is answered before any middleware runs, and aiohttp writes it as plain text."""
from __future__ import annotations

from http import HTTPStatus

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from backends.server.errors import ErrorType, error_body


class _JsonErrorsHandler(RequestHandler):
    """aiohttp's connection protocol with `handle_error` answering in the OpenAI envelope."""
    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)   # logs it; raises if a response already began
        if status >= 500:
            body = error_body("Internal server error.", ErrorType.SERVER)
        else:
            body = error_body(message or HTTPStatus(status).phrase, ErrorType.INVALID_REQUEST)
        response = web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
        response.force_close()
        return response


class _JsonErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorsHandler(self, loop=self._loop, **self._kwargs)


def answer_protocol_errors_in_json(runner: web.BaseRunner) -> None:
    """After `runner.setup()`: every connection of the runner's server answers protocol errors in JSON."""
    server = runner.server
    if type(server) is not web.Server:
        raise TypeError(f"expected aiohttp's own web.Server, got {type(server)!r}")
    server.__class__ = _JsonErrorsServer
