"""The dispatcher and the disaggregated provider in one process: the real gateway app under aiohttp's
TestServer, upstreams as small in-process aiohttp apps scripted per test. Beside the subprocess tests
(test_fallback.py, test_pd.py), these run in well under a second each and reach the gateway's objects.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config.gateway_config import parse_config
from gateway.services import SERVICES

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


# --- in-process upstreams ----------------------------------------------------------------------------

@dataclass
class Upstream:
    """One scripted upstream: `answers` is consumed one per generation request (empty: a normal answer)."""
    role: str = "both"                                       # both | prefill | decode
    answers: list[tuple[int, str]] = field(default_factory=list)  # (status, error code) to answer next
    bodies: list[dict[str, Any]] = field(default_factory=list)    # the generation bodies received
    headers: list[Any] = field(default_factory=list)              # their headers (case-insensitive)
    healthy: bool = True                                     # GET /health answers 200
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")


def _error(status: int, code: str) -> web.Response:
    return web.json_response({"error": {"message": f"scripted {status}", "type": "upstream", "code": code}},
                             status=status)


def _upstream_app(upstream: Upstream) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": upstream.healthy}, status=200 if upstream.healthy else 503)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        upstream.bodies.append(body)
        upstream.headers.append(request.headers.copy())
        if upstream.answers:
            status, code = upstream.answers.pop(0)
            return _error(status, code)
        if upstream.role == "prefill":
            return web.json_response({
                "id": "cmpl-p", "object": "chat.completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "first "},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": f"x{len(upstream.bodies)}"}})
        words = ["tok1 ", "tok2 "] if upstream.role == "decode" else ["a ", "b ", "c "]
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-u", "object": "chat.completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 5 + len(words)}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in words:
            event = {"id": "cmpl-u", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post(CHAT, generate)])
    return app


Start = Callable[..., Awaitable[Any]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """start(role, ...) -> Upstream, or start(config dict) -> TestClient of the gateway app."""
    servers: list[TestServer | TestClient] = []

    async def start_one(what: str | dict[str, Any]) -> Any:
        if isinstance(what, str):
            upstream = Upstream(role=what)
            upstream.server = TestServer(_upstream_app(upstream))
            await upstream.server.start_server()
            servers.append(upstream.server)
            return upstream
        client = TestClient(TestServer(create_app(parse_config(yaml.safe_dump(what), {}))))
        await client.start_server()
        servers.append(client)
        return client

    yield start_one
    for server in reversed(servers):
        await server.close()


def _config(providers: dict[str, Any]) -> dict[str, Any]:
    return {"models": {"m": {"providers": list(providers), "policy": {"name": "round_robin"}}},
            "providers": providers, "pollers": {"health_interval_s": 0.05},
            "retries": {"backoff_initial_s": 0.001, "backoff_jitter_s": 0.001}}


async def _stream_text(client: TestClient, body: dict[str, Any]) -> str:
    async with client.post(CHAT, json={**body, "stream": True}) as response:
        assert response.status == 200
        raw = await response.read()
    text = ""
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            choice = orjson.loads(event[6:])["choices"][0]
            text += choice.get("delta", {}).get("content") or ""
    assert raw.rstrip().endswith(b"data: [DONE]")
    return text


def _metric(client: TestClient, name: str, **labels: str) -> float:
    """A counter's value in the app's own registry (0 when it has no sample yet)."""
    value = client.app[SERVICES].metrics.registry.get_sample_value(name, labels)
    return value or 0.0


# --- the dispatcher ----------------------------------------------------------------------------------

async def test_plain_request_is_relayed_whole_and_streamed(start: Start) -> None:
    upstream = await start("both")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url], "upstream_model": "up",
                                        "api_key": "sk-up"}}))
    response = await client.post(CHAT, json=BODY, headers={"x-request-id": "req-1"})
    assert response.status == 200
    assert (await response.json())["choices"][0]["message"]["content"] == "a b c "
    assert upstream.bodies[-1]["model"] == "up"                    # renamed upstream
    assert upstream.headers[-1]["Authorization"] == "Bearer sk-up"
    assert upstream.headers[-1]["x-request-id"] == "req-1"
    assert await _stream_text(client, BODY) == "a b c "


async def test_a_503_is_retried_on_the_other_endpoint_and_a_400_is_the_clients(start: Start) -> None:
    bad, good = await start("both"), await start("both")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [bad.url, good.url]}}))
    bad.answers = [(503, "busy")]
    response = await client.post(CHAT, json=BODY)  # round robin: the first request goes to `bad` first
    assert response.status == 200
    assert len(bad.bodies) == 1 and len(good.bodies) == 1
    assert _metric(client, "switchyard_upstream_errors_total", provider="p", cause="HTTP 503") == 1
    assert _metric(client, "switchyard_retries_total", model="m") == 1
    good.answers = [(400, "bad_thing")]
    bad.answers = [(400, "bad_thing")]
    response = await client.post(CHAT, json=BODY)
    assert response.status == 400 and (await response.json())["error"]["code"] == "bad_thing"


async def test_an_exhausted_provider_falls_back_to_the_next_in_the_chain(start: Start) -> None:
    first, second = await start("both"), await start("both")
    client = await start(_config({"first": {"kind": "openai", "endpoints": [first.url]},
                                  "second": {"kind": "openai", "endpoints": [second.url]}}))
    first.answers = [(500, "down")]
    response = await client.post(CHAT, json=BODY)
    assert response.status == 200 and len(first.bodies) == 1 and len(second.bodies) == 1
    assert _metric(client, "switchyard_fallbacks_total", model="m", from_provider="first",
                   to_provider="second") == 1


async def test_when_every_upstream_fails_the_error_names_what_was_tried(start: Start) -> None:
    upstream = await start("both")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    upstream.answers = [(503, "busy")]
    response = await client.post(CHAT, json=BODY)
    assert response.status == 502
    message = (await response.json())["error"]["message"]
    assert f"tried: p@{upstream.url}: HTTP 503: scripted 503" in message
    assert len(upstream.bodies) == 1       # nothing was left to retry on: answered at once


# --- the disaggregated provider ----------------------------------------------------------------------

async def _pd(start: Start, *, unified: bool = False) -> tuple[Upstream, Upstream, Upstream | None, TestClient]:
    prefill, decode = await start("prefill"), await start("decode")
    providers: dict[str, Any] = {"pd": {"kind": "switchyard-pd", "prefill_endpoints": [prefill.url],
                                        "endpoints": [decode.url]}}
    both = None
    if unified:
        both = await start("both")
        providers["u"] = {"kind": "openai", "endpoints": [both.url]}
    return prefill, decode, both, await start(_config(providers))


async def test_pd_prefill_then_decode_whole_and_streamed(start: Start) -> None:
    prefill, decode, _, client = await _pd(start)
    response = await client.post(CHAT, json=BODY)
    answer = await response.json()
    assert response.status == 200 and answer["choices"][0]["message"]["content"] == "first tok1 tok2 "
    assert answer["id"] == "cmpl-p" and "kv_transfer_params" not in answer
    leg1, leg2 = prefill.bodies[-1], decode.bodies[-1]
    assert leg1["max_tokens"] == 1 and leg1["kv_transfer_params"] == {"do_remote_decode": True}
    assert leg2["kv_transfer_params"]["remote_request_id"] == "x1" and leg2["max_tokens"] == 8
    assert await _stream_text(client, BODY) == "first tok1 tok2 "


async def test_pd_kv_transfer_failed_is_redone_with_a_new_prefill(start: Start) -> None:
    prefill, decode, _, client = await _pd(start)
    decode.answers = [(503, "kv_transfer_failed")]
    response = await client.post(CHAT, json=BODY)
    assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == \
        "first tok1 tok2 "
    assert len(prefill.bodies) == 2 and len(decode.bodies) == 2
    assert _metric(client, "switchyard_pd_redos_total", model="m", code="kv_transfer_failed") == 1
    # The redo is a failed leg like any other: counted with the upstream errors.
    assert _metric(client, "switchyard_upstream_errors_total", provider="pd", cause="kv_transfer_failed") == 1


async def test_pd_decode_failure_is_retried_without_a_new_prefill(start: Start) -> None:
    prefill, decode, _, client = await _pd(start)
    decode.answers = [(500, "oops")]
    response = await client.post(CHAT, json=BODY)
    # The only decode endpoint failed: the held prefill cannot be decoded elsewhere, nothing else is left.
    assert response.status == 502 and len(prefill.bodies) == 1 and len(decode.bodies) == 1


async def test_pd_falls_back_to_unified_when_the_decode_pool_is_down(start: Start) -> None:
    prefill, decode, both, client = await _pd(start, unified=True)
    assert both is not None
    decode.healthy = False
    registry = client.app[SERVICES].registry
    for _ in range(200):  # the health poller runs every 50 ms
        if not registry.endpoints[decode.url].healthy:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the health poller did not mark the decode endpoint down")
    response = await client.post(CHAT, json=BODY)
    assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == "a b c "
    assert prefill.bodies == [] and decode.bodies == []   # no prefill is spent on a pool that cannot decode
    assert _metric(client, "switchyard_pd_fallbacks_total", model="m", provider="pd",
                   cause="decode_pool_unavailable") == 1

