"""OpenAI's Responses API over the chat dispatch (gateway/openai_responses.py): requests as chat bodies and
refusals as a table, a whole chat completion as a Response, and the stream translator as a property (any cut
of the upstream's bytes gives the same events, in order, with consecutive sequence numbers)."""
from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.anthropic.sse import SseFramer
from gateway.errors import BadRequest
from gateway.openai_responses import ResponseEvents, ResponseHeader, to_chat_body, to_response
from tests.gateway.test_anthropic_translate import cut

HELLO = [{"role": "user", "content": "Hi"}]
REQUEST = {"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5, "metadata": {"k": "v"}}
HEADER = ResponseHeader("resp_1", "msg_1", 1700000000, REQUEST)


@pytest.mark.parametrize(("body", "chat"), [
    ({"model": "m", "input": "Hi"}, {"model": "m", "messages": HELLO}),
    (REQUEST, {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, *HELLO], "max_tokens": 5}),
    ({"model": "m", "input": [{"type": "message", "role": "developer", "content": "D"},
                              {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                           {"type": "input_text", "text": "b"}]},
                              {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}],
      "temperature": 0.5, "top_p": 0.9, "stream": True, "store": True, "user": "u",
      "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low"}},
     {"model": "m", "messages": [{"role": "developer", "content": "D"}, {"role": "user", "content": "a\nb"},
                                 {"role": "assistant", "content": "c"}],
      "temperature": 0.5, "top_p": 0.9, "stream": True, "stream_options": {"include_usage": True}}),
])
def test_responses_request_becomes_a_chat_body(body: dict[str, Any], chat: dict[str, Any]) -> None:
    assert to_chat_body(body) == chat


@pytest.mark.parametrize(("body", "param"), [
    ([], None),
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_0"}, "previous_response_id"),
    ({"model": "m", "input": "x", "conversation": "conv_0"}, "conversation"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {}}}},
     "text.format"),
    ({"model": "m", "input": "x", "instructions": 3}, "instructions"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "input[0]"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"model": "m", "input": [{"role": "user", "content": 3}]}, "input[0].content"),
])
def test_what_has_no_chat_form_is_refused(body: Any, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        to_chat_body(body)
    assert info.value.param == param


def test_whole_chat_completion_to_response() -> None:
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                               "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 9, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}}
    response = to_response(completion, HEADER)
    assert response["id"] == "resp_1" and response["object"] == "response" and response["model"] == "m"
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"] == [{"type": "message", "id": "msg_1", "status": "incomplete", "role": "assistant",
                                   "content": [{"type": "output_text", "text": "Hello", "annotations": [],
                                                "logprobs": []}]}]
    assert response["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
                                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    assert response["instructions"] == "Be brief." and response["metadata"] == {"k": "v"}
    completion["choices"][0]["finish_reason"] = "stop"
    assert to_response(completion, HEADER)["status"] == "completed"
    assert to_response(completion, HEADER)["incomplete_details"] is None


def openai_stream(texts: list[str], finish: str, with_usage: bool = True) -> bytes:
    chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in texts]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}]
    if with_usage:
        chunks += [{"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": len(texts)}}]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def events(data: bytes) -> list[dict[str, Any]]:
    """The stream's events, checking that each one's name is its type and that sequence numbers run on."""
    out = []
    for event in SseFramer().feed(data):
        if event.data is None:
            continue
        payload = orjson.loads(event.data)
        assert event.name == payload["type"] and payload["sequence_number"] == len(out)
        out.append(payload)
    return out


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=6), max_size=5), cuts=st.lists(st.integers(0, 10**6), max_size=12),
       crlf=st.booleans(), finish=st.sampled_from(["stop", "length"]))
def test_response_events_from_any_cut(texts: list[str], cuts: list[int], crlf: bool, finish: str) -> None:
    data = openai_stream(texts, finish)
    if crlf:
        data = data.replace(b"\n", b"\r\n")
    translator = ResponseEvents(HEADER)
    got = events(b"".join(translator.feed(piece) for piece in cut(data, cuts)) + translator.close())
    terminal = "response.incomplete" if finish == "length" else "response.completed"
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(texts), "response.output_text.done", "response.content_part.done",
        "response.output_item.done", terminal]
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    text = "".join(texts)
    assert "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta") == text
    assert all(e["item_id"] == "msg_1" for e in got if "item_id" in e)
    final = got[-1]["response"]
    assert final["id"] == "resp_1" and final["output"][0]["content"][0]["text"] == text
    assert final["status"] == ("incomplete" if finish == "length" else "completed")
    assert final["usage"]["input_tokens"] == 10 and final["usage"]["output_tokens"] == len(texts)
    assert translator.close() == b""


def test_response_events_keepalive_error_and_cut_streams() -> None:
    translator = ResponseEvents(HEADER)
    assert translator.feed(b": keepalive\n\n") == b": keepalive\n\n"
    error = b'data: {"error": {"message": "boom", "type": "upstream_error", "param": null, "code": "x"}}\n\n'
    got = events(translator.feed(error + b"data: [DONE]\n\n"))
    assert got[-1]["type"] == "response.failed"
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "x", "message": "boom"}
    assert translator.close() == b""
    # an upstream that ends without [DONE]: the response is ended anyway, without usage from upstream
    cut_short = ResponseEvents(HEADER)
    data = openai_stream(["a", "b"], "length", with_usage=False).removesuffix(b"data: [DONE]\n\n")
    got = events(cut_short.feed(data) + cut_short.close())
    assert got[-1]["type"] == "response.incomplete" and got[-1]["response"]["usage"] is None
