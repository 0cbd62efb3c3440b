"""The error middleware on a real aiohttp app: every failure becomes an OpenAI error body, the app lives on."""
from __future__ import annotations

import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from backends.server.app import error_middleware
from backends.server.app_keys import METRICS_KEY
from backends.server.errors import APIError, model_not_found
from backends.server.metrics import ServerMetrics


async def boom(request: web.Request) -> web.Response:
    raise RuntimeError("a bug")


async def refuse(request: web.Request) -> web.Response:
    raise model_not_found("gpt-9")


async def big(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(text="ok")


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.fixture
async def client() -> TestClient:
    app = web.Application(middlewares=[error_middleware], client_max_size=1024)
    app[METRICS_KEY] = ServerMetrics()
    app.router.add_routes([web.get("/boom", boom), web.get("/refuse", refuse), web.post("/big", big),
                           web.get("/ok", ok)])
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


@pytest.mark.parametrize(("method", "path", "data", "status", "error_type", "code"), [
    ("GET", "/boom", None, 500, "server_error", None),
    ("GET", "/refuse", None, 404, "invalid_request_error", "model_not_found"),
    ("POST", "/big", b"x" * 5000, 413, "invalid_request_error", "request_too_large"),
    ("GET", "/nowhere", None, 404, "not_found_error", None),
    ("POST", "/ok", b"{}", 405, "invalid_request_error", None),
])
async def test_errors_become_openai_bodies(client: TestClient, caplog: pytest.LogCaptureFixture, method: str,
                                           path: str, data: bytes | None, status: int, error_type: str,
                                           code: str | None) -> None:
    with caplog.at_level(logging.ERROR, logger="backends.server.app"):
        resp = await client.request(method, path, data=data)
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (error_type, code) and error["message"]
    assert ("unhandled error" in caplog.text) == (status == 500)   # only the unexpected is logged as an error
    assert "a bug" not in error["message"]                          # internals do not leak to the client
    assert (await client.get("/ok")).status == 200                  # and the app still serves
    if status == 405:
        assert set(resp.headers["Allow"].split(",")) == {"GET", "HEAD"}


async def test_statuses_are_counted_by_route(client: TestClient) -> None:
    await client.get("/boom")
    await client.get("/ok")
    await client.get("/nowhere/1")
    await client.get("/nowhere/2")
    text = client.app[METRICS_KEY].render().decode()
    assert 'switchyard_requests_total{route="/boom",status="500"} 1.0' in text
    assert 'switchyard_requests_total{route="/ok",status="200"} 1.0' in text
    assert 'switchyard_requests_total{route="unmatched",status="404"} 2.0' in text


def test_api_error_body() -> None:
    err = APIError("bad", param="top_p", code="invalid_value")
    assert err.status == 400
    assert err.body() == {"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p",
                                    "code": "invalid_value"}}
