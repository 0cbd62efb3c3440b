"""The Anthropic Messages API on the gateway (POST /v1/messages), in one process: the real gateway app under
aiohttp's TestServer, the official `anthropic` and `openai` SDKs as clients, and two scripted in-process upstreams:
an OpenAI-compatible one, and a fake Anthropic API (a third-party service that cannot run here). The `anthropic`
provider kind: test_anthropic_provider.py. Real workers: tests/clients/test_anthropic_sdk.py.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config.gateway_config import parse_config

KEY = "sk-test-key"
HELLO = [{"role": "user", "content": "Hello"}]


# --- scripted upstreams ------------------------------------------------------------------------------

@dataclass
class Upstream:
    """An OpenAI chat upstream (`kind="openai"`) or a fake Anthropic Messages API (`kind="anthropic"`)."""
    kind: str
    answers: list[tuple[int, str]] = field(default_factory=list)  # (status, error type) to answer next
    stream_error: str | None = None              # anthropic: open the next stream with this error event
    break_stream: bool = False                   # openai: cut the connection after the first text chunk
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)   # openai: answer with these tool calls
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")


async def _openai_answer(request: web.Request, upstream: Upstream, body: dict[str, Any]) -> web.StreamResponse:
    """'Hello there' in two pieces; a stop string in the request is reported as matched (as vLLM does)."""
    stop = body.get("stop") or []
    end = {"finish_reason": "stop", "stop_reason": stop[0]} if stop else {"finish_reason": "stop"}
    usage = {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22,
             "prompt_tokens_details": {"cached_tokens": 16}}
    if upstream.calls:
        return await _openai_tool_calls(request, upstream.calls, body, usage)
    if not body.get("stream"):
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                                               **end}], "usage": usage})
    chunks = [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None},
              {"delta": {"content": "Hello"}, "finish_reason": None}, {"delta": {"content": " there"}, **end}]
    events = b"".join(b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "model": body["model"],
                                                "choices": [{"index": 0, **c}]}) + b"\n\n" for c in chunks)
    if upstream.break_stream:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(events.split(b"\n\n")[0] + b"\n\n" + events.split(b"\n\n")[1] + b"\n\n")
        assert request.transport is not None
        request.transport.abort()
        return response
    if (body.get("stream_options") or {}).get("include_usage"):
        events += b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\n"
    return await _stream(request, events + b"data: [DONE]\n\n")


async def _openai_tool_calls(request: web.Request, calls: list[tuple[str, dict[str, Any]]], body: dict[str, Any],
                             usage: dict[str, Any]) -> web.StreamResponse:
    """'Let me check.' and then `calls`, as vLLM's tool parsers send them: a call's id and name first, its
    arguments in 5-character pieces; streamed calls are numbered from 3 (an upstream's `index` is only a key)."""
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
                  for i, (name, args) in enumerate(calls)]
    if not body.get("stream"):
        message = {"role": "assistant", "content": "Let me check.", "tool_calls": tool_calls}
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                                  "usage": usage})
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}, {"content": "Let me check."}]
    for i, call in enumerate(tool_calls):
        arguments = call["function"]["arguments"]
        deltas.append({"tool_calls": [{"index": i + 3, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": i + 3, "function": {"arguments": arguments[at:at + 5]}}]}
                   for at in range(0, len(arguments), 5)]
    chunks = [{"index": 0, "delta": d, "finish_reason": None} for d in deltas]
    chunks.append({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
    events = b"".join(b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [c]}) + b"\n\n"
                      for c in chunks)
    events += b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\n"
    return await _stream(request, events + b"data: [DONE]\n\n")


async def _anthropic_answer(request: web.Request, upstream: Upstream, body: dict[str, Any]) -> web.StreamResponse:
    usage = {"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0}
    if not body.get("stream"):
        return web.json_response({"id": "msg_up", "type": "message", "role": "assistant", "model": body["model"],
                                  "content": [{"type": "text", "text": "Bonjour toi"}], "stop_reason": "end_turn",
                                  "stop_sequence": None, "usage": usage})
    if upstream.stream_error is not None:
        error, upstream.stream_error = upstream.stream_error, None
        return await _stream(request, _named({"type": "error", "error": {"type": error, "message": "busy"}}))
    message = {"id": "msg_up", "type": "message", "role": "assistant", "model": body["model"], "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 1}}
    events = [{"type": "message_start", "message": message},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              {"type": "ping"},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Bonjour"}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " toi"}},
              {"type": "content_block_stop", "index": 0},
              {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
               "usage": {"output_tokens": 2}},
              {"type": "message_stop"}]
    return await _stream(request, b"".join(_named(e) for e in events))


def _named(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


async def _stream(request: web.Request, data: bytes) -> web.StreamResponse:
    """`data` in 7-byte writes: events arrive cut anywhere, as they may over TCP."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for start in range(0, len(data), 7):
        await response.write(data[start:start + 7])
    await response.write_eof()
    return response


def _upstream_app(upstream: Upstream) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        upstream.bodies.append(body)
        upstream.headers.append(request.headers.copy())
        if upstream.answers:
            status, kind = upstream.answers.pop(0)
            error = {"type": "error", "error": {"type": kind, "message": f"scripted {status}"}} \
                if upstream.kind == "anthropic" else \
                {"error": {"message": f"scripted {status}", "type": kind, "param": None, "code": kind}}
            return web.json_response(error, status=status)
        answer = _anthropic_answer if upstream.kind == "anthropic" else _openai_answer
        return await answer(request, upstream, body)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    path = "/v1/messages" if upstream.kind == "anthropic" else "/v1/chat/completions"
    app = web.Application()
    app.add_routes([web.get("/health", health), web.post(path, generate)])
    return app


Start = Callable[..., Awaitable[Any]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """start("openai" | "anthropic") -> Upstream, or start(config dict) -> TestClient of the gateway app."""
    servers: list[TestServer | TestClient] = []

    async def start_one(what: str | dict[str, Any]) -> Any:
        if isinstance(what, str):
            upstream = Upstream(kind=what)
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


def _config(providers: dict[str, Any], chain: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"models": {"m": {"providers": chain or list(providers), "policy": {"name": "round_robin"}}},
            "providers": providers, "pollers": {"health_interval_s": 0.05},
            "retries": {"backoff_initial_s": 0.001, "backoff_jitter_s": 0.001}, **extra}


def _sdk(client: TestClient, api_key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(client.make_url("")).rstrip("/"), api_key=api_key, max_retries=0)


def _openai_sdk(client: TestClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=KEY, max_retries=0)


# --- POST /v1/messages -------------------------------------------------------------------------------

async def test_a_message_is_translated_both_ways(start: Start) -> None:
    upstream = await start("openai")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    message = await _sdk(client).messages.create(
        model="m", max_tokens=50, system=[{"type": "text", "text": "Be brief."}], metadata={"user_id": "u1"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},   # this SDK version has no arguments for them
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "m" and message.content[0].type == "text" and message.content[0].text == "Hello there"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens,
            message.usage.cache_creation_input_tokens) == (4, 16, 2, 0)
    assert upstream.bodies[-1] == {
        "model": "m", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]}


async def test_a_stream_has_anthropics_events_and_usage(start: Start) -> None:
    upstream = await start("openai")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    async with _sdk(client).messages.stream(model="m", max_tokens=50, system="Be brief.", messages=HELLO) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    types = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                   "content_block_stop", "message_delta", "message_stop")]
    assert types == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == "Hello there" and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (4, 16, 2)
    assert upstream.bodies[-1]["stream"] is True and upstream.bodies[-1]["stream_options"] == {"include_usage": True}
    # the raw bytes: every event is named after its type, a ping follows the first block's start
    raw = await client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HELLO, "stream": True})
    text = (await raw.read()).decode()
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    assert "event: ping\ndata: {\"type\":\"ping\"}" in text and "[DONE]" not in text
    assert text.rstrip().endswith('event: message_stop\ndata: {"type":"message_stop"}')


async def test_a_stream_cut_upstream_ends_with_an_error_event(start: Start) -> None:
    upstream = await start("openai")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    upstream.break_stream = True
    raw = await client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HELLO, "stream": True})
    assert raw.status == 200
    events = [e for e in (await raw.read()).decode().split("\n\n") if e]
    assert [e.split("\n")[0] for e in events] == [
        "event: message_start", "event: content_block_start", "event: ping", "event: content_block_delta",
        "event: error"]
    assert '"type":"api_error"' in events[-1] and "failed mid-stream" in events[-1]
    with pytest.raises(anthropic.APIStatusError, match="failed mid-stream"):
        async with _sdk(client).messages.stream(model="m", max_tokens=5, messages=HELLO) as stream:
            async for _ in stream:
                pass


async def test_stop_sequences_are_reported(start: Start) -> None:
    upstream = await start("openai")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    sdk = _sdk(client)
    message = await sdk.messages.create(model="m", max_tokens=50, messages=HELLO, stop_sequences=["END", "STOP"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    assert upstream.bodies[-1]["stop"] == ["END", "STOP"]
    async with sdk.messages.stream(model="m", max_tokens=50, messages=HELLO, stop_sequences=["END"]) as stream:
        final = await stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tōkyō", "days": [1, 2]})]


async def test_tool_use_both_ways_whole_and_streamed(start: Start) -> None:
    """Claude Code's loop through the gateway: tools go up in OpenAI's form, the upstream's tool calls come
    back as tool_use blocks (whole, and streamed as the SDK accumulates them), and the next turn's
    tool_use and tool_result blocks go up as tool_calls and tool messages."""
    upstream = await start("openai")
    upstream.calls = CALLS
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    sdk = _sdk(client)
    asked = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
    message = await sdk.messages.create(model="m", max_tokens=50, messages=asked, tools=[WEATHER],
                                        tool_choice={"type": "any", "disable_parallel_tool_use": False})
    async with sdk.messages.stream(model="m", max_tokens=50, messages=asked, tools=[WEATHER]) as stream:
        final = await stream.get_final_message()
    for answer in (message, final):
        assert answer.stop_reason == "tool_use"
        assert [b.type for b in answer.content] == ["text", "tool_use", "tool_use"]
        assert answer.content[0].text == "Let me check."
        assert [(b.id, b.name, b.input) for b in answer.content[1:]] == [
            ("call_0", "get_weather", {"city": "Paris"}), ("call_1", "get_weather", {"city": "Tōkyō", "days": [1, 2]})]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": WEATHER["input_schema"]}}]
    assert upstream.bodies[0]["tools"] == tools and upstream.bodies[0]["tool_choice"] == "required"
    assert upstream.bodies[1]["tools"] == tools and "tool_choice" not in upstream.bodies[1]
    # count_tokens counts the tools too (this gateway has no tokenizer for "m": the estimate)
    with_tools = await sdk.messages.count_tokens(model="m", messages=asked, tools=[WEATHER])
    assert with_tools.input_tokens > (await sdk.messages.count_tokens(model="m", messages=asked)).input_tokens

    upstream.calls = []
    results = [{"type": "tool_result", "tool_use_id": "call_0", "content": "18 C"},
               {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "no data"}],
                "is_error": True},
               {"type": "text", "text": "Summarise."}]
    turn = await sdk.messages.create(model="m", max_tokens=50, tools=[WEATHER], messages=[
        *asked, {"role": "assistant", "content": final.content}, {"role": "user", "content": results}])
    assert turn.content[0].text == "Hello there" and turn.stop_reason == "end_turn"
    assert upstream.bodies[-1]["messages"][1:] == [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Tōkyō","days":[1,2]}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "Error: no data"},
        {"role": "user", "content": "Summarise."}]


async def test_errors_have_anthropics_shape_and_status(start: Start) -> None:
    upstream = await start("openai")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}},
                                 api_keys=[{"key_id": "k", "key": KEY, "max_requests_per_min": 12}]))
    sdk = _sdk(client)
    cases: list[tuple[dict[str, Any], type[anthropic.APIStatusError], str]] = [
        ({"model": "m", "messages": HELLO}, anthropic.BadRequestError, "invalid_request_error"),  # no max_tokens
        ({"model": "nope", "max_tokens": 5, "messages": HELLO}, anthropic.NotFoundError, "not_found_error"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
         anthropic.BadRequestError, "invalid_request_error"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
         anthropic.BadRequestError, "invalid_request_error"),
        ({"model": "m", "max_tokens": 10**9, "messages": HELLO}, anthropic.BadRequestError, "invalid_request_error"),
    ]
    for body, error, kind in cases:
        with pytest.raises(error) as caught:
            await sdk.post("/v1/messages", body=body, cast_to=anthropic.types.Message)
        answer = caught.value.body
        assert answer == {"type": "error", "error": {"type": kind, "message": answer["error"]["message"]}}
    with pytest.raises(anthropic.AuthenticationError) as auth_error:
        await _sdk(client, api_key="wrong").messages.create(model="m", max_tokens=5, messages=HELLO)
    assert auth_error.value.body["error"]["type"] == "authentication_error"
    raw = await client.post("/v1/messages", data=b"{not json", headers={"x-api-key": KEY})
    assert raw.status == 400 and (await raw.json())["error"]["type"] == "invalid_request_error"
    raw = await client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HELLO},
                            headers={"x-api-key": KEY, "anthropic-version": "1999-01-01"})
    assert raw.status == 400 and "anthropic-version" in (await raw.json())["error"]["message"]
    upstream.answers = [(400, "invalid_request_error")]    # the upstream's own 400, relayed in Anthropic's shape
    with pytest.raises(anthropic.BadRequestError) as relayed:
        await sdk.messages.create(model="m", max_tokens=5, messages=HELLO)
    assert relayed.value.body == {"type": "error",
                                  "error": {"type": "invalid_request_error", "message": "scripted 400"}}
    upstream.answers = [(503, "busy")] * 8                 # every try fails: the gateway's 502, Anthropic's shape
    with pytest.raises(anthropic.InternalServerError) as failed:
        await sdk.messages.create(model="m", max_tokens=5, messages=HELLO)
    assert failed.value.status_code == 502 and failed.value.body["error"]["type"] == "api_error"
    upstream.answers = []
    sdk_bearer = anthropic.AsyncAnthropic(base_url=str(client.make_url("")).rstrip("/"), auth_token=KEY,
                                          max_retries=0)        # Authorization: Bearer works here too
    assert (await sdk_bearer.messages.create(model="m", max_tokens=5, messages=HELLO)).content[0].text
    with pytest.raises(anthropic.RateLimitError) as limited:  # the key's 12 requests a minute are spent
        for _ in range(12):
            await sdk.messages.create(model="m", max_tokens=5, messages=HELLO)
    assert limited.value.body["error"]["type"] == "rate_limit_error"


async def test_messages_fall_back_and_keep_session_affinity(start: Start) -> None:
    down, first, second = await start("openai"), await start("openai"), await start("openai")
    providers = {"down": {"kind": "openai", "endpoints": [down.url]},
                 "up": {"kind": "openai", "endpoints": [first.url, second.url]}}
    config = _config(providers)
    config["models"]["m"]["policy"] = {"name": "session_affinity"}
    client = await start(config)
    down.answers = [(503, "busy")] * 100
    sdk = _sdk(client)
    for _ in range(4):
        message = await sdk.messages.create(model="m", max_tokens=5, messages=HELLO,
                                            extra_headers={"x-session-affinity": "agent-7"})
        assert message.content[0].text == "Hello there"
    assert down.bodies   # tried first, then the chain's next provider answered
    assert sorted((len(first.bodies), len(second.bodies))) == [0, 4]   # one endpoint for the session
