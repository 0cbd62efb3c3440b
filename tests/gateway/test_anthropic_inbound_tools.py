"""Tool use on POST /v1/messages, the pure translations (gateway/translate/anthropic/inbound_tools.py and the stream
translator): Anthropic's tools, tool_choice, tool_use and tool_result blocks as a chat body; an answer's tool
calls as tool_use blocks, whole and streamed (bytes cut anywhere give the same events). Through the real app
and the official SDK: tests/gateway/test_anthropic.py."""
from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from gateway.translate.anthropic.inbound import MessageEvents, MessageHeader, to_chat_body, to_message
from tests.gateway.test_anthropic_translate import cut, events

HEADER = MessageHeader("msg_1", "m", (), num_input_tokens=7)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "weather", "description": "Weather by city", "input_schema": SCHEMA, "cache_control": {"type": "x"}}
FUNCTION = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA, "description": "Weather by city"}}
HELLO = [{"role": "user", "content": "Hi"}]
BASE = {"model": "m", "max_tokens": 5}


@pytest.mark.parametrize(("fields", "chat_fields"), [
    ({"tools": [TOOL]}, {"tools": [FUNCTION]}),
    ({"tools": [{"type": "custom", "name": "t", "input_schema": {}}]},
     {"tools": [{"type": "function", "function": {"name": "t", "parameters": {}}}]}),
    ({"tools": [TOOL], "tool_choice": {"type": "auto"}}, {"tools": [FUNCTION], "tool_choice": "auto"}),
    ({"tools": [TOOL], "tool_choice": {"type": "any"}}, {"tools": [FUNCTION], "tool_choice": "required"}),
    ({"tools": [TOOL], "tool_choice": {"type": "none"}}, {"tools": [FUNCTION], "tool_choice": "none"}),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True}},
     {"tools": [FUNCTION], "tool_choice": {"type": "function", "function": {"name": "weather"}},
      "parallel_tool_calls": False}),
    ({"tools": []}, {}),
    ({"tool_choice": {"type": "auto"}}, {}),     # no tools: nothing to choose from, nothing sent
])
def test_tools_and_tool_choice(fields: dict[str, Any], chat_fields: dict[str, Any]) -> None:
    assert to_chat_body({**BASE, "messages": HELLO, **fields}) == {**BASE, "messages": HELLO, **chat_fields}


def test_a_conversation_that_used_tools() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Nice", "n": [1, 2.5]}}
    messages = [
        *HELLO,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"},
                                          {"type": "text", "text": "Checking."}, call,
                                          {**call, "id": "toolu_2", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True},
                                     {"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    ]
    calls = [{"id": "toolu_1", "type": "function",
              "function": {"name": "weather", "arguments": '{"city":"Nice","n":[1,2.5]}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    assert to_chat_body({**BASE, "messages": messages, "tools": [TOOL]})["messages"] == [
        *HELLO,
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error"},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": None, "tool_calls": calls[:1]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a\nb"},
    ]


def completion(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3}}


def test_an_answers_tool_calls_are_tool_use_blocks() -> None:
    calls = [{"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": "not json"}},
             {"id": "call_c", "type": "function", "function": {"name": "weather", "arguments": "[1]"}}]
    message = to_message(completion({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"), HEADER)
    assert message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "tool_use", "id": "call_a", "name": "weather", "input": {"city": "Oslo"}},
        # arguments that are no JSON object are kept, where a client can see them
        {"type": "tool_use", "id": "call_b", "name": "weather", "input": {"arguments": "not json"}},
        {"type": "tool_use", "id": "call_c", "name": "weather", "input": {"arguments": "[1]"}}]
    with_text = to_message(completion({"role": "assistant", "content": "Hm.", "tool_calls": calls[:1]}, "tool_calls"),
                           HEADER)
    assert [b["type"] for b in with_text["content"]] == ["text", "tool_use"]
    assert with_text["content"][0]["text"] == "Hm."
    # no tool calls: one text block, empty or not, as before
    assert to_message(completion({"role": "assistant", "content": ""}, "stop"), HEADER)["content"] == [
        {"type": "text", "text": ""}]


def tool_stream(parts: list[tuple[str, Any]]) -> bytes:
    """An OpenAI chat stream of ("text", piece) and ("call", (key, name, [argument pieces])) parts."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    for kind, value in parts:
        if kind == "text":
            deltas.append({"content": value})
        else:
            key, name, pieces = value
            deltas.append({"tool_calls": [{"index": key, "id": f"id{key}", "type": "function",
                                           "function": {"name": name, "arguments": pieces[0] if pieces else ""}}]})
            deltas += [{"tool_calls": [{"index": key, "function": {"arguments": p}}]} for p in pieces[1:]]
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def pieces_of(text: str, sizes: list[int]) -> list[str]:
    out, at = [], 0
    for size in sizes:
        if at < len(text):
            out.append(text[at:at + size])
            at += size
    return out + ([text[at:]] if at < len(text) else [])


@settings(max_examples=60, deadline=None)
@given(lead=st.text(max_size=5),
       args=st.lists(st.dictionaries(st.text(max_size=3), st.integers(-10**6, 10**6)), min_size=1, max_size=3),
       sizes=st.lists(st.integers(1, 4), max_size=6), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_streamed_tool_calls_from_any_cut(lead: str, args: list[dict[str, int]], sizes: list[int],
                                          cuts: list[int]) -> None:
    parts: list[tuple[str, Any]] = [("text", lead)] if lead else []
    parts += [("call", (7 + i, f"f{i}", pieces_of(orjson.dumps(a).decode(), sizes))) for i, a in enumerate(args)]
    translator = MessageEvents(HEADER)
    got = events(b"".join(translator.feed(p) for p in cut(tool_stream(parts), cuts)) + translator.close())
    starts = [e for e in got if e["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == list(range(len(starts)))
    assert [s["content_block"]["type"] for s in starts] == ["text"] * bool(lead) + ["tool_use"] * len(args)
    assert [(s["content_block"]["id"], s["content_block"]["name"]) for s in starts if s["content_block"]["type"] ==
            "tool_use"] == [(f"id{7 + i}", f"f{i}") for i in range(len(args))]
    # each block is stopped before the next starts, and every delta falls inside its own open block
    open_block = None
    for event in got:
        if event["type"] == "content_block_start":
            assert open_block is None
            open_block = event["index"]
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_block
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_block
            open_block = None
    assert open_block is None
    first = 1 if lead else 0
    for i, arguments in enumerate(args):
        json = "".join(e["delta"]["partial_json"] for e in got
                       if e["type"] == "content_block_delta" and e["index"] == first + i)
        assert orjson.loads(json) == arguments
    assert "".join(e["delta"].get("text", "") for e in got if e["type"] == "content_block_delta") == lead
    assert got[-2]["delta"]["stop_reason"] == "tool_use" and got[-1] == {"type": "message_stop"}
    assert [e["type"] for e in got[:3]] == ["message_start", "content_block_start", "ping"]


def test_text_after_a_tool_call_opens_a_new_text_block() -> None:
    translator = MessageEvents(HEADER)
    got = events(translator.feed(tool_stream([("call", (0, "f", ["{}"])), ("text", "after")])))
    assert [(e["type"], e.get("index")) for e in got if e["type"].startswith("content_block")] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
