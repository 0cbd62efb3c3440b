"""The client's side of every fault scenario: one request read whole (`Reply`), its SSE events, and the two
outcomes a client may get: a whole answer, or a clear OpenAI-style error (a JSON body, or an in-band
`data: {"error": ...}` event followed by `data: [DONE]` once a stream has started)."""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from tests.gateway.conftest import metric
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import await_until

CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]"
ERROR_KEYS = {"message", "type", "param", "code"}
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=120)  # bounds a broken run only


@dataclass(frozen=True, slots=True)
class Reply:
    status: int                      # the HTTP status
    headers: Mapping[str, str]       # the response headers
    body: bytes                      # the whole body, as it arrived

    @property
    def events(self) -> list[bytes]:
        """The SSE events and comments, in order (the blank line after each removed)."""
        return [event for event in self.body.split(b"\n\n") if event]

    def json(self) -> Any:
        return orjson.loads(self.body)

    def payloads(self) -> list[Any]:
        """The JSON payloads of the `data:` events, in order ([DONE], comments and broken events left out)."""
        out = []
        for event in self.events:
            if event.startswith(b"data: {"):
                try:
                    out.append(orjson.loads(event[6:]))
                except orjson.JSONDecodeError:
                    continue
        return out


def new_request_id() -> str:
    return f"fault-{uuid.uuid4().hex[:12]}"


def chat(model: str, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": stream, **extra}


async def post(url: str, body: Mapping[str, Any], *, path: str = CHAT,
               headers: Mapping[str, str] | None = None) -> Reply:
    """One request on a connection of its own, read to its end."""
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client, \
            client.post(url + path, json=body, headers=headers) as response:
        return Reply(response.status, dict(response.headers), await response.read())


def content(event: bytes) -> str | None:
    """The text of a content event (chat delta or completion text); None for anything else."""
    if not event.startswith(b"data: {"):
        return None
    try:
        payload = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return None
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def streamed_text(reply: Reply) -> str:
    return "".join(text for event in reply.events if (text := content(event)) is not None)


def whole_text(reply: Reply) -> str:
    choice = reply.json()["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def assert_whole_answer(reply: Reply, text: str, stream: bool) -> None:
    """A whole answer: 200, the expected text, and for a stream no error event and [DONE] last."""
    assert reply.status == 200, reply.body[:2000]
    if not stream:
        assert whole_text(reply) == text
        return
    assert reply.events[-1] == DONE, reply.events[-3:]
    assert not any(event.startswith(b'data: {"error"') for event in reply.events), reply.body[:2000]
    assert streamed_text(reply) == text


def assert_openai_error(reply: Reply, status: int, code: str) -> dict[str, Any]:
    """A JSON error body of exactly OpenAI's shape, with `status` and `code`; returns its `error`."""
    assert reply.status == status, reply.body[:2000]
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error: dict[str, Any] = body["error"]
    assert error["code"] == code and isinstance(error["message"], str) and error["message"], error
    return error


def error_event(event: bytes) -> dict[str, Any]:
    """The `error` of an in-band error event, checked for OpenAI's shape."""
    assert event.startswith(b'data: {"error"'), event[:200]
    body = orjson.loads(event[6:])
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error: dict[str, Any] = body["error"]
    return error


async def assert_gateway_serves(gateway: GatewayProcess) -> None:
    """The gateway process survived the fault, still answers /health, and holds no lease on any endpoint
    once the test's requests have ended (a lease is released just after its response's last byte)."""
    assert gateway.alive, gateway.log()[-3000:]
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client, \
            client.get(gateway.url + "/health") as response:
        assert response.status == 200
    await await_until(lambda: metric(gateway, "switchyard_inflight_requests") == 0, "no request in flight")
