"""Tool use through the `anthropic` provider kind (gateway/translate/anthropic/outbound.py): the chat request's tools,
tool_choice and tool-call history as tables; the answer's tool_use blocks, whole and as a stream cut at any
byte; and the official `openai` SDK through the real gateway app against a fake Anthropic API that calls tools.
"""
from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings, strategies as st

from gateway.translate.anthropic.outbound import ChatChunks, Untranslatable, to_chat_completion, to_messages_request
from gateway.translate.sse import SseFramer
from tests.gateway.test_anthropic import (
    Start,
    Upstream,
    _config,
    _named,
    _openai_sdk,
    _stream,
    start as start,  # the fixture: the gateway app and its upstreams
)
from tests.gateway.test_anthropic_translate import cut

HELLO = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather", "input_schema": SCHEMA}
CLOCK_TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_use(call_id: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def result(call_id: str, text: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": text}


ASKED = {"role": "assistant", "content": "Checking.",
         "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}'), call("c2", "get_time", "{}")]}
ASKED_BLOCKS = {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                 tool_use("c1", "get_weather", {"city": "Paris"}),
                                                 tool_use("c2", "get_time", {})]}


# --- requests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "expected"), [
    ({"tools": [WEATHER, CLOCK]}, {"tools": [WEATHER_TOOL, CLOCK_TOOL]}),
    ({"tools": [WEATHER], "tool_choice": "auto"}, {"tools": [WEATHER_TOOL], "tool_choice": {"type": "auto"}}),
    ({"tools": [WEATHER], "tool_choice": "required"}, {"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}}),
    ({"tools": [WEATHER], "tool_choice": "none"}, {"tools": [WEATHER_TOOL], "tool_choice": {"type": "none"}}),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}}),
    ({"tools": [WEATHER], "parallel_tool_calls": False},
     {"tools": [WEATHER_TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
     {"tools": [WEATHER_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "parallel_tool_calls": False},
     {"tools": [WEATHER_TOOL],
      "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}),
    # Anthropic's {"type": "none"} has no disable_parallel_tool_use; parallel_tool_calls: true is the default
    ({"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": False},
     {"tools": [WEATHER_TOOL], "tool_choice": {"type": "none"}}),
    ({"tools": [WEATHER], "parallel_tool_calls": True}, {"tools": [WEATHER_TOOL]}),
])
def test_tools_and_tool_choice(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    assert to_messages_request({"messages": HELLO, **fields}, "up") == {
        "model": "up", "messages": HELLO, "max_tokens": 4096, **expected}


@pytest.mark.parametrize(("messages", "expected"), [
    # an assistant's calls become tool_use blocks after its text; the results, one user turn
    ([*HELLO, ASKED, {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
      {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "12:00"}]}],
     [*HELLO, ASKED_BLOCKS, {"role": "user", "content": [result("c1", "Sunny"), result("c2", "12:00")]}]),
    # a user message right after the results joins their turn, as text after them
    ([*HELLO, ASKED, {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
      {"role": "tool", "tool_call_id": "c2", "content": "12:00"}, {"role": "user", "content": "And Rome?"},
      {"role": "assistant", "content": "Also sunny."}],
     [*HELLO, ASKED_BLOCKS,
      {"role": "user", "content": [result("c1", "Sunny"), result("c2", "12:00"),
                                   {"type": "text", "text": "And Rome?"}]},
      {"role": "assistant", "content": "Also sunny."}]),
    # no text (content null or empty): only the calls; an empty result carries no content; "" is no arguments
    ([*HELLO, {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_time", "")]},
      {"role": "tool", "tool_call_id": "c1", "content": ""}],
     [*HELLO, {"role": "assistant", "content": [tool_use("c1", "get_time", {})]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1"}]}]),
    # plain text turns of one role stay apart, as before tools
    ([*HELLO, *HELLO], [*HELLO, *HELLO]),
])
def test_tool_calls_and_results_in_the_conversation(messages: list[dict[str, Any]],
                                                    expected: list[dict[str, Any]]) -> None:
    body = {"messages": [{"role": "system", "content": "S"}, *messages], "tools": [WEATHER, CLOCK]}
    request = to_messages_request(body, "up")
    assert request["messages"] == expected and request["system"] == "S"


@pytest.mark.parametrize("body", [
    {"messages": HELLO, "tools": [{"type": "custom", "custom": {"name": "grep"}}]},
    {"messages": HELLO, "tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
    {"messages": HELLO, "tools": {"get_weather": WEATHER}},
    {"messages": HELLO, "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
    {"messages": HELLO, "tools": [WEATHER], "tool_choice": "sometimes"},
    {"messages": HELLO, "functions": [WEATHER["function"]]},
    {"messages": [*HELLO, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
    {"messages": [*HELLO, {"role": "function", "name": "f", "content": "x"}]},
    {"messages": [*HELLO, {"role": "tool", "content": "no id"}]},
    {"messages": [*HELLO, {"role": "assistant", "tool_calls": [call("c1", "f", "not json")]}]},
    {"messages": [*HELLO, {"role": "assistant", "tool_calls": [call("c1", "f", "[1, 2]")]}]},
    {"messages": [*HELLO, {"role": "assistant", "tool_calls": [call("c1", "f", '"Paris"')]}]},
    {"messages": [*HELLO, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "custom", "custom": {}}]}]},
    {"messages": [*HELLO, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
])
def test_tool_use_without_a_messages_form(body: dict[str, Any]) -> None:
    with pytest.raises(Untranslatable):
        to_messages_request(body, "up")


# --- answers -----------------------------------------------------------------------------------------

CALLED = [tool_use("toolu_1", "get_weather", {"city": "Paris", "units": ["c", "f"]}),
          tool_use("toolu_2", "get_time", {})]


@pytest.mark.parametrize(("text", "content"), [
    ([{"type": "text", "text": "Let me "}, {"type": "text", "text": "check."}], "Let me check."),
    ([], None),   # no text: content null, as OpenAI sends it
])
def test_whole_message_with_tool_use(text: list[dict[str, Any]], content: str | None) -> None:
    completion = to_chat_completion({"id": "msg_1", "model": "c", "content": [*text, *CALLED],
                                     "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 2}})
    assert completion["choices"] == [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": content,
        "tool_calls": [call("toolu_1", "get_weather", '{"city":"Paris","units":["c","f"]}'),
                       call("toolu_2", "get_time", "{}")]}}]


def tool_stream(texts: list[str], pieces: list[list[str]]) -> bytes:
    """An Anthropic stream: text block 0 (if any text), then a tool_use block per entry of `pieces`, whose
    input JSON arrives in those pieces (an empty first piece, as Anthropic sends one)."""
    message = {"id": "msg_t", "model": "c", "usage": {"input_tokens": 3, "output_tokens": 1}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": message}, {"type": "ping"}]
    if texts:
        events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}
                   for t in texts]
        events.append({"type": "content_block_stop", "index": 0})
    for number, (block, json_pieces) in enumerate(zip(CALLED, pieces, strict=True)):
        index = number + bool(texts)
        events.append({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}})
        events += [{"type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": p}} for p in ["", *json_pieces]]
        events.append({"type": "content_block_stop", "index": index})
    events += [{"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 9}}, {"type": "message_stop"}]
    return b"".join(_named(e) for e in events)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def chunks_of(out: bytes) -> list[dict[str, Any]]:
    chunks = [orjson.loads(e.data) for e in SseFramer().feed(out) if e.data and e.data != b"[DONE]"]
    for chunk in chunks:
        chunk.pop("created")
    return chunks


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
       json_cuts=st.lists(st.lists(st.integers(0, 100), max_size=6), min_size=2, max_size=2),
       cuts=st.lists(st.integers(0, 10**6), max_size=16))
def test_tool_use_stream_from_any_cut(texts: list[str], json_cuts: list[list[int]], cuts: list[int]) -> None:
    inputs = [orjson.dumps(block["input"]).decode() for block in CALLED]
    data = tool_stream(texts, [split(text, c) for text, c in zip(inputs, json_cuts, strict=True)])
    whole = ChatChunks(False)
    translator = ChatChunks(False)
    out = b"".join(translator.feed(piece) for piece in cut(data, cuts))
    assert translator.ended and out.endswith(b"data: [DONE]\n\n")
    assert chunks_of(out) == chunks_of(whole.feed(data))
    choices = [c["choices"][0] for c in chunks_of(out)]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "".join(texts)
    deltas = [d for c in choices for d in c["delta"].get("tool_calls", [])]
    assert all(len(c["delta"].get("tool_calls", [])) <= 1 for c in choices)
    starts = [d for d in deltas if "id" in d]
    assert starts == [{"index": 0, "id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                                     "arguments": ""}},
                      {"index": 1, "id": "toolu_2", "type": "function", "function": {"name": "get_time",
                                                                                     "arguments": ""}}]
    for number, block in enumerate(CALLED):
        arguments = "".join(d["function"]["arguments"] for d in deltas if d["index"] == number)
        assert orjson.loads(arguments) == block["input"]
    assert all(d["function"]["arguments"] for d in deltas if "id" not in d)   # empty pieces are not sent
    assert choices[-1] == {"index": 0, "delta": {}, "finish_reason": "tool_calls"}
    assert translator.usage is not None and translator.usage["completion_tokens"] == 9


# --- through the gateway -----------------------------------------------------------------------------

def _tool_app(upstream: Upstream) -> web.Application:
    """A fake Anthropic API that answers every request with 'Let me check.' and the two CALLED tool uses."""
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        upstream.bodies.append(body)
        if not body.get("stream"):
            return web.json_response({
                "id": "msg_up", "type": "message", "role": "assistant", "model": body["model"],
                "content": [{"type": "text", "text": "Let me check."}, *CALLED], "stop_reason": "tool_use",
                "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 20}})
        pieces = [split(orjson.dumps(block["input"]).decode(), [3, 9, 14]) for block in CALLED]
        return await _stream(request, tool_stream([], pieces))   # a stream that opens with a tool_use block

    app = web.Application()
    app.add_routes([web.post("/v1/messages", generate)])
    return app


@pytest.fixture
async def claude() -> AsyncIterator[Upstream]:
    upstream = Upstream(kind="anthropic")
    upstream.server = TestServer(_tool_app(upstream))
    await upstream.server.start_server()
    yield upstream
    await upstream.server.close()


async def test_openai_sdk_tool_calls_through_an_anthropic_upstream(start: Start, claude: Upstream) -> None:
    client = await start(_config({"claude": {"kind": "anthropic", "endpoints": [claude.url], "health_path": None}}))
    sdk = _openai_sdk(client)
    tools: Any = [WEATHER, CLOCK]
    reply = await sdk.chat.completions.create(model="m", max_tokens=30, messages=HELLO, tools=tools,
                                              tool_choice="required", parallel_tool_calls=False)
    assert claude.bodies[-1]["tools"] == [WEATHER_TOOL, CLOCK_TOOL]
    assert claude.bodies[-1]["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls or []
    assert [(c.id, c.function.name, orjson.loads(c.function.arguments)) for c in calls] == [
        (block["id"], block["name"], block["input"]) for block in CALLED]

    history: Any = [*HELLO, reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
                    {"role": "tool", "tool_call_id": "toolu_2", "content": "12:00"}]
    stream = await sdk.chat.completions.create(model="m", max_tokens=30, messages=history, tools=tools,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               stream=True)
    chunks = [chunk async for chunk in stream]
    sent = claude.bodies[-1]
    assert sent["tool_choice"] == {"type": "tool", "name": "get_time"} and sent["stream"] is True
    assert sent["messages"][1:] == [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, *CALLED]},
        {"role": "user", "content": [result("toolu_1", "Sunny"), result("toolu_2", "12:00")]}]
    streamed: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            assert delta.function is not None
            entry["id"] += delta.id or ""
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(e["id"], e["name"], orjson.loads(e["arguments"])) for _, e in sorted(streamed.items())] == [
        (block["id"], block["name"], block["input"]) for block in CALLED]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
