"""The fake upstream's broken answers (a request's behaviour with `"fault"`; tests/support/fake_upstream_app.py
hands it here after its stalls and gates): cut, malformed and oversized answers as a failing or hostile
OpenAI-compatible server sends them. Content is the fake's usual `tok{i} ` text, so tests expect the same words.

Faults, and the behaviour fields each reads besides `chunks` (events, default 3):
- "malformed": a stream with `raw` (text, sent verbatim: a broken event or line) before event `at`, then the rest.
- "cut_in_event": a stream whose connection is aborted halfway through event `at`.
- "end_early": a stream that ends without `data: [DONE]` after `at` events, on a clean end of its chunked body
  or, with `"framing": "close"` (a read-to-close body, as HTTP/1.0 servers send), by closing the connection.
- "cut_body": a whole (non-streaming) answer whose connection is aborted halfway through its Content-Length.
- "big_error": a `status` error whose JSON body is `num_bytes` long.
- "big_head": a 200 whose head carries a header `num_bytes` long.
- "big_answer": a 200 whose content is `num_bytes` of text (streamed: one event, written in 64 KiB pieces).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"
_PIECE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Answer:
    name: str          # the fake's name (`served_by`)
    model: str         # the model the request named
    chat: bool         # /v1/chat/completions (else /v1/completions)
    stream: bool       # the request asked for SSE

    def event(self, text: str) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}} if self.chat else {"index": 0, "text": text}
        event = {"id": "fake", "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "model": self.model, "served_by": self.name, "choices": [{**choice, "finish_reason": None}]}
        return b"data: " + orjson.dumps(event) + b"\n\n"

    def whole(self, text: str) -> bytes:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}} if self.chat \
            else {"index": 0, "text": text}
        return orjson.dumps({"id": "fake", "object": "chat.completion" if self.chat else "text_completion",
                             "model": self.model, "served_by": self.name,
                             "choices": [{**choice, "finish_reason": "stop"}]})


def words(num_chunks: int) -> str:
    """The text of `num_chunks` events, as the fake sends it."""
    return "".join(f"tok{i} " for i in range(num_chunks))


async def serve(request: web.Request, name: str, body: Mapping[str, Any],
                behaviour: Mapping[str, Any]) -> web.StreamResponse:
    answer = _Answer(name, str(body.get("model", "")), request.path.endswith("chat/completions"),
                     bool(body.get("stream")))
    return await _FAULTS[behaviour["fault"]](request, answer, behaviour)


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


async def _malformed(request: web.Request, answer: _Answer, behaviour: Mapping[str, Any]) -> web.StreamResponse:
    response = await _sse(request)
    for i in range(int(behaviour.get("chunks", 3))):
        if i == behaviour.get("at", 1):
            await response.write(str(behaviour["raw"]).encode())
        await response.write(answer.event(f"tok{i} "))
    await response.write(DONE)
    await response.write_eof()
    return response


async def _cut_in_event(request: web.Request, answer: _Answer, behaviour: Mapping[str, Any]) -> web.StreamResponse:
    response = await _sse(request)
    at = int(behaviour.get("at", 1))
    for i in range(at):
        await response.write(answer.event(f"tok{i} "))
    event = answer.event(f"tok{at} ")
    await response.write(event[:len(event) // 2])
    request.transport.abort()  # type: ignore[union-attr]
    return response


async def _end_early(request: web.Request, answer: _Answer, behaviour: Mapping[str, Any]) -> web.StreamResponse:
    events = b"".join(answer.event(f"tok{i} ") for i in range(int(behaviour.get("at", 1))))
    if behaviour.get("framing") == "close":
        # No Content-Length, no chunks: the body is whatever arrives before the connection closes.
        transport = request.transport
        assert transport is not None
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + events)
        transport.close()
        return web.Response()  # never sent: the connection is closed
    response = await _sse(request)
    await response.write(events)
    await response.write_eof()
    return response


async def _cut_body(request: web.Request, answer: _Answer, behaviour: Mapping[str, Any]) -> web.StreamResponse:
    whole = answer.whole(words(int(behaviour.get("chunks", 3))))
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(whole)
    await response.prepare(request)
    await response.write(whole[:len(whole) // 2])
    request.transport.abort()  # type: ignore[union-attr]
    return response


async def _big_error(request: web.Request, answer: _Answer, behaviour: Mapping[str, Any]) -> web.StreamResponse:
    status = int(behaviour.get("status", 500))
    error = {"error": {"message": "x" * int(behaviour["num_bytes"]), "type": "fake", "param": None,
                       "code": str(status)}}
    return web.Response(status=status, body=orjson.dumps(error), content_type="application/json")


async def _big_head(request: web.Request, answer: _Answer, behaviour: Mapping[str, Any]) -> web.StreamResponse:
    return web.Response(body=answer.whole(words(3)), content_type="application/json",
                        headers={"X-Padding": "x" * int(behaviour["num_bytes"])})


async def _big_answer(request: web.Request, answer: _Answer, behaviour: Mapping[str, Any]) -> web.StreamResponse:
    text = "x" * int(behaviour["num_bytes"])
    if not answer.stream:
        return web.Response(body=answer.whole(text), content_type="application/json")
    response = await _sse(request)
    event = answer.event(text)
    for start in range(0, len(event), _PIECE_BYTES):
        await response.write(event[start:start + _PIECE_BYTES])
    await response.write(DONE)
    await response.write_eof()
    return response


_FAULTS: Mapping[str, Callable[[web.Request, _Answer, Mapping[str, Any]], Awaitable[web.StreamResponse]]] = {
    "malformed": _malformed, "cut_in_event": _cut_in_event, "end_early": _end_early, "cut_body": _cut_body,
    "big_error": _big_error, "big_head": _big_head, "big_answer": _big_answer,
}
