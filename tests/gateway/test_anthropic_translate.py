"""The pure Anthropic <-> OpenAI translations (gateway/translate/anthropic/): tables for requests, stop reasons, usage
and errors; properties for the stream translators (bytes cut anywhere give the same events)."""
from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from gateway.errors import BadRequest
from gateway.translate.anthropic.inbound import (
    MessageEvents,
    MessageHeader,
    check_version,
    stop_reason,
    to_chat_body,
    usage,
)
from gateway.translate.anthropic.outbound import (
    ChatChunks,
    Untranslatable,
    chat_usage,
    openai_error,
    to_chat_completion,
    to_messages_request,
)
from gateway.translate.sse import SseEvent, SseFramer

HELLO = [{"role": "user", "content": "Hi"}]
HEADER = MessageHeader("msg_1", "m", ("END",), num_input_tokens=7)
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


# --- requests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "chat"), [
    ({"model": "m", "max_tokens": 5, "messages": HELLO},
     {"model": "m", "max_tokens": 5, "messages": HELLO}),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "system": "S", "stream": True, "stop_sequences": ["x"],
      "temperature": 0, "top_p": 0.5, "top_k": 3, "metadata": {"user_id": "u"}, "cache_control": {}},
     {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "S"}, *HELLO], "stream": True,
      "stream_options": {"include_usage": True}, "stop": ["x"], "temperature": 0, "top_p": 0.5, "top_k": 3}),
    ({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
      "messages": [{"role": "user", "content": [{"type": "text", "text": "C", "cache_control": {"type": "x"}}]}]},
     {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "A\nB"},
                                                  {"role": "user", "content": "C"}]}),
    # a prefilled answer is continued in place, not answered in a new assistant turn
    ({"model": "m", "max_tokens": 5, "messages": [*HELLO, {"role": "assistant", "content": "Hel"}]},
     {"model": "m", "max_tokens": 5, "messages": [*HELLO, {"role": "assistant", "content": "Hel"}],
      "continue_final_message": True, "add_generation_prompt": False}),
])
def test_messages_request_becomes_a_chat_body(body: dict[str, Any], chat: dict[str, Any]) -> None:
    assert to_chat_body(body) == chat


@pytest.mark.parametrize(("body", "param"), [
    ([], None),
    ({"max_tokens": 5, "messages": HELLO}, "model"),
    ({"model": "m", "messages": HELLO}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": HELLO}, "max_tokens"),
    ({"model": "m", "max_tokens": True, "messages": HELLO}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": {"a": 1}, "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "system": 3}, "system"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [{"name": "t"}]}, "tools.0.input_schema"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": {"name": "t"}}, "tools"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [{"input_schema": {}}]}, "tools.0.name"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools.0.type"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice.name"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    # values of the wrong JSON type where a name is expected: a 400, not a TypeError
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [{**TOOL, "type": ["x"]}]}, "tools.0.type"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tools": [TOOL],
      "tool_choice": {"type": "tool", "name": ["weather"]}}, "tool_choice.name"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]},
     "messages.0.content.0"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"model": "m", "max_tokens": 5, "messages": [*HELLO, {"role": "assistant", "content": [CALL]}]}, "messages.1"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [CALL]}]}, "messages.0.content.0"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [{**CALL, "input": "x"}]}, *HELLO]},
     "messages.0.content.0.input"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image"}]}]}]},
     "messages.0.content.0.content.0"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "stop_sequences": "x"}, "stop_sequences"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "stop_sequences": [""]}, "stop_sequences"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "top_k": -1}, "top_k"),
    ({"model": "m", "max_tokens": 5, "messages": HELLO, "stream": "yes"}, "stream"),
])
def test_bad_messages_requests_are_refused(body: Any, param: str | None) -> None:
    with pytest.raises(BadRequest) as caught:
        to_chat_body(body)
    assert caught.value.param == param


@pytest.mark.parametrize(("version", "ok"), [
    (None, True), ("2023-06-01", True), ("2023-01-01", True), ("2026-10-21", True),
    ("2022-12-31", False), ("2023-6-1", False), ("2023-02-30", False), ("latest", False), ("", False),
])
def test_anthropic_version(version: str | None, ok: bool) -> None:
    if ok:
        check_version(version)
    else:
        with pytest.raises(BadRequest, match="anthropic-version"):
            check_version(version)


@pytest.mark.parametrize(("body", "request_body"), [
    ({"messages": [{"role": "developer", "content": "D"}, {"role": "system", "content": "S"}, *HELLO],
      "max_completion_tokens": 9, "temperature": 1.7, "stop": "\n", "user": "u", "stream": True, "top_k": 2},
     {"model": "up", "messages": HELLO, "system": "D\nS", "max_tokens": 9, "temperature": 1.0,
      "stop_sequences": ["\n"], "metadata": {"user_id": "u"}, "stream": True, "top_k": 2}),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                   {"role": "assistant", "content": None}]},
     {"model": "up", "messages": [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}],
      "max_tokens": 4096}),
])
def test_chat_body_becomes_a_messages_request(body: dict[str, Any], request_body: dict[str, Any]) -> None:
    assert to_messages_request(body, "up") == request_body


@pytest.mark.parametrize("body", [
    {"messages": HELLO, "n": 2},
    {"messages": HELLO, "tools": [{"type": "function"}]},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": 3}]},
    {"messages": HELLO, "response_format": {"type": "json_object"}},
    {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"messages": HELLO, "logprobs": True},
    {"messages": HELLO, "top_logprobs": 2},
])
def test_chat_bodies_without_a_messages_form(body: dict[str, Any]) -> None:
    with pytest.raises(Untranslatable):
        to_messages_request(body, "up")


# --- answers -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("choice", "expected"), [
    ({"finish_reason": "stop"}, ("end_turn", None)),
    ({"finish_reason": "stop", "stop_reason": None}, ("end_turn", None)),
    ({"finish_reason": "stop", "stop_reason": "END"}, ("stop_sequence", "END")),
    ({"finish_reason": "stop", "stop_reason": "other"}, ("end_turn", None)),   # not one the client sent
    ({"finish_reason": "stop", "stop_reason": 2}, ("end_turn", None)),         # a stop token id (vLLM)
    ({"finish_reason": "length"}, ("max_tokens", None)),
    ({"finish_reason": "tool_calls"}, ("tool_use", None)),
    ({"finish_reason": "content_filter"}, ("refusal", None)),
    ({"finish_reason": "abort"}, ("end_turn", None)),
    ({"finish_reason": None}, (None, None)),
])
def test_stop_reasons(choice: dict[str, Any], expected: tuple[str | None, str | None]) -> None:
    assert stop_reason(choice, ("END",)) == expected


def test_usage_both_ways() -> None:
    openai_usage = {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
    anthropic_usage = usage(openai_usage, 0, 0)
    assert anthropic_usage == {"input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 32,
                               "cache_creation_input_tokens": 0}
    assert chat_usage(anthropic_usage) == {**openai_usage, "total_tokens": 43}
    assert usage(None, 7, 2) == {"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 0,
                                 "cache_creation_input_tokens": 0}
    assert usage({"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 9}}, 0, 1)["input_tokens"] == 0


def test_whole_message_to_chat_completion() -> None:
    completion = to_chat_completion({"id": "msg_1", "model": "c", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}],
                                     "stop_reason": "stop_sequence", "stop_sequence": "##",
                                     "usage": {"input_tokens": 1, "output_tokens": 2}})
    assert completion["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ab"},
                                      "finish_reason": "stop", "stop_reason": "##"}]
    assert completion["id"] == "chatcmpl-msg_1" and completion["usage"]["total_tokens"] == 3


def test_errors_both_ways() -> None:
    body = orjson.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    assert orjson.loads(openai_error(body)) == {"error": {"message": "busy", "type": "overloaded_error",
                                                          "param": None, "code": "overloaded_error"}}
    assert orjson.loads(openai_error(b"<html>bad gateway")) == {"error": {
        "message": "<html>bad gateway", "type": "api_error", "param": None, "code": "api_error"}}


# --- streams -----------------------------------------------------------------------------------------

def openai_stream(texts: list[str], finish: dict[str, Any], with_usage: bool = True) -> bytes:
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in texts]
    chunks += [{"choices": [{"index": 0, "delta": {}, **finish}]}]
    if with_usage:
        chunks += [{"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": len(texts),
                                             "prompt_tokens_details": {"cached_tokens": 4}}}]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def events(data: bytes) -> list[dict[str, Any]]:
    """(name, payload) pairs of an Anthropic stream, checking that each event's name is its type."""
    out = []
    for event in SseFramer().feed(data):
        assert event.data is not None
        payload = orjson.loads(event.data)
        assert event.name == payload["type"]
        out.append(payload)
    return out


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=6), max_size=5), cuts=st.lists(st.integers(0, 10**6), max_size=12),
       crlf=st.booleans())
def test_message_events_from_any_cut(texts: list[str], cuts: list[int], crlf: bool) -> None:
    data = openai_stream(texts, {"finish_reason": "stop", "stop_reason": "END"})
    if crlf:
        data = data.replace(b"\n", b"\r\n")
    translator = MessageEvents(HEADER)
    out = b"".join(translator.feed(piece) for piece in cut(data, cuts)) + translator.close()
    got = events(out)
    assert [e["type"] for e in got] == ["message_start", "content_block_start", "ping",
                                        *["content_block_delta"] * len(texts),
                                        "content_block_stop", "message_delta", "message_stop"]
    assert got[0]["message"]["id"] == "msg_1" and got[0]["message"]["usage"]["input_tokens"] == 7
    assert "".join(e["delta"]["text"] for e in got if e["type"] == "content_block_delta") == "".join(texts)
    assert got[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert got[-2]["usage"] == {"input_tokens": 6, "output_tokens": len(texts), "cache_read_input_tokens": 4,
                                "cache_creation_input_tokens": 0}


def test_message_events_keepalive_error_and_cut_streams() -> None:
    translator = MessageEvents(HEADER)
    assert events(translator.feed(b": keepalive\n\n")) == [{"type": "ping"}]
    error = b'data: {"error": {"message": "boom", "type": "upstream_error", "param": null, "code": "x"}}\n\n'
    assert events(translator.feed(error + b"data: [DONE]\n\n")) == [
        {"type": "error", "error": {"type": "api_error", "message": "boom"}}]
    assert translator.close() == b""
    overloaded = MessageEvents(HEADER).feed(error.replace(b'"x"', b'"no_upstream_available"'))
    assert events(overloaded)[0]["error"]["type"] == "overloaded_error"
    # an upstream that ends without [DONE]: the message is ended anyway, without usage from upstream
    cut_short = MessageEvents(HEADER)
    data = openai_stream(["a", "b"], {"finish_reason": "length"}, with_usage=False).removesuffix(b"data: [DONE]\n\n")
    got = events(cut_short.feed(data) + cut_short.close())
    assert got[-2]["delta"]["stop_reason"] == "max_tokens" and got[-2]["usage"]["output_tokens"] == 2
    assert got[-1] == {"type": "message_stop"} and cut_short.close() == b""


def anthropic_stream(texts: list[str]) -> bytes:
    message = {"id": "msg_u", "model": "c", "usage": {"input_tokens": 3, "cache_read_input_tokens": 16,
                                                      "output_tokens": 1}}
    payloads: list[dict[str, Any]] = [{"type": "message_start", "message": message},
                                      {"type": "content_block_start", "index": 0}, {"type": "ping"}]
    payloads += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}} for t in texts]
    payloads += [{"type": "content_block_stop", "index": 0},
                 {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                  "usage": {"output_tokens": len(texts)}},
                 {"type": "message_stop"}]
    return b"".join(b"event: " + p["type"].encode() + b"\ndata: " + orjson.dumps(p) + b"\n\n" for p in payloads)


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=6), max_size=5), cuts=st.lists(st.integers(0, 10**6), max_size=12),
       include_usage=st.booleans())
def test_chat_chunks_from_any_cut(texts: list[str], cuts: list[int], include_usage: bool) -> None:
    translator = ChatChunks(include_usage)
    out = b"".join(translator.feed(piece) for piece in cut(anthropic_stream(texts), cuts))
    assert translator.ended and out.endswith(b"data: [DONE]\n\n")
    chunks = [orjson.loads(e.data) for e in SseFramer().feed(out) if e.data and e.data != b"[DONE]"]
    assert all(isinstance(e, SseEvent) and e.name is None for e in SseFramer().feed(out))
    with_choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert with_choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"].get("content", "") for c in with_choices) == "".join(texts)
    assert with_choices[-1]["finish_reason"] == "stop"
    assert all(c["id"] == "chatcmpl-msg_u" and c["object"] == "chat.completion.chunk" for c in chunks)
    usage_chunks = [c for c in chunks if "usage" in c]
    assert len(usage_chunks) == int(include_usage)
    assert translator.usage == {"prompt_tokens": 19, "completion_tokens": len(texts), "total_tokens": 19 + len(texts),
                                "prompt_tokens_details": {"cached_tokens": 16}}


def test_chat_chunks_error_event() -> None:
    translator = ChatChunks(False)
    out = translator.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n')
    assert out.startswith(b'data: {"error"') and out.endswith(b"data: [DONE]\n\n") and translator.ended
    assert translator.usage is None
