"""OpenAI's Responses API stream translator (gateway/translate/responses.py) as a property: any cut of the upstream's
bytes gives the same events, in order, with consecutive sequence numbers; text alone and text with tool calls.
Requests and whole answers: test_responses_translate.py."""
from __future__ import annotations

import itertools
from typing import Any

import orjson
from hypothesis import given, settings, strategies as st

from gateway.translate.responses import ResponseEvents
from gateway.translate.sse import SseFramer
from tests.gateway.test_anthropic_translate import cut
from tests.gateway.test_responses_translate import HEADER


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


def tool_stream(before: list[str], calls: list[tuple[str, str, list[str]]], after: list[str]) -> bytes:
    """Text pieces, then each call (id, name, argument pieces) as vLLM's tool parsers send them (id and name
    first, under an `index` that is only a key), then more text, a tool_calls finish, usage and [DONE]."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}, *({"content": t} for t in before)]
    for number, (call_id, name, pieces) in enumerate(calls):
        key = number + 3
        deltas.append({"tool_calls": [{"index": key, "id": call_id, "type": "function",
                                       "function": {"name": name, "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": key, "function": {"arguments": piece}}]} for piece in pieces]
    deltas += [{"content": t} for t in after]
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
               {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 7}}]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added"]
MESSAGE_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_DONE = ["response.function_call_arguments.done", "response.output_item.done"]


@settings(max_examples=60, deadline=None)
@given(before=st.lists(st.text(min_size=1, max_size=6), max_size=3),
       after=st.lists(st.text(min_size=1, max_size=6), max_size=2),
       arguments=st.lists(st.dictionaries(st.text(max_size=4), st.text(max_size=8) | st.integers(-99, 99),
                                          max_size=3), min_size=2, max_size=2),
       argument_cuts=st.lists(st.integers(0, 100), max_size=6),
       cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_tool_call_events_from_any_cut(before: list[str], after: list[str], arguments: list[dict[str, Any]],
                                       argument_cuts: list[int], cuts: list[int]) -> None:
    """Text, two calls whose arguments come in pieces, maybe text after them: each part is its own output
    item, opened at the next output_index and done before the next opens; the completed response lists them."""
    jsons = [orjson.dumps(a).decode() for a in arguments]
    calls = [("call_a", "get_weather", split(jsons[0], argument_cuts)),
             ("call_b", "get_time", split(jsons[1], argument_cuts[::-1]))]
    data = tool_stream(before, calls, after)
    translator = ResponseEvents(HEADER)
    got = events(b"".join(translator.feed(piece) for piece in cut(data, cuts)) + translator.close())
    expected = ["response.created", "response.in_progress"]
    if before:
        expected += [*MESSAGE_EVENTS, *["response.output_text.delta"] * len(before), *MESSAGE_DONE]
    for _, _, pieces in calls:
        expected += ["response.output_item.added", *["response.function_call_arguments.delta"] * len(pieces),
                     *CALL_DONE]
    if after:
        expected += [*MESSAGE_EVENTS, *["response.output_text.delta"] * len(after), *MESSAGE_DONE]
    assert [e["type"] for e in got] == [*expected, "response.completed"]

    final = got[-1]["response"]
    output = final["output"]
    kinds = ["message"] * bool(before) + ["function_call"] * 2 + ["message"] * bool(after)
    assert [item["type"] for item in output] == kinds and all(i["status"] == "completed" for i in output)
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 7
    function_calls = [item for item in output if item["type"] == "function_call"]
    assert [(c["call_id"], c["name"], orjson.loads(c["arguments"])) for c in function_calls] == [
        ("call_a", "get_weather", arguments[0]), ("call_b", "get_time", arguments[1])]
    messages = [item for item in output if item["type"] == "message"]
    assert [m["content"][0]["text"] for m in messages] == ["".join(t) for t in (before, after) if t]
    assert len({item["id"] for item in output}) == len(output) and output[0]["id"] == ("msg_1" if before else
                                                                                       output[0]["id"])
    # every event names its item by output_index (and id); what an item's events carry adds up to the item
    for index, item in enumerate(output):
        own = [e for e in got if e.get("output_index") == index]
        added, done = own[0], own[-1]
        assert added["type"] == "response.output_item.added" and added["item"]["status"] == "in_progress"
        assert done == {"type": "response.output_item.done", "sequence_number": done["sequence_number"],
                        "output_index": index, "item": item}
        assert all(e["item_id"] == item["id"] for e in own[1:-1])
        if item["type"] == "function_call":
            assert added["item"] == {**item, "arguments": "", "status": "in_progress"}
            assert "".join(e["delta"] for e in own if e["type"].endswith("arguments.delta")) == item["arguments"]
            assert own[-2]["arguments"] == item["arguments"]
        else:
            assert "".join(e["delta"] for e in own if e["type"].endswith("text.delta")) == item["content"][0]["text"]
    assert translator.close() == b""


def test_tool_calls_alone_and_a_cut_short_call() -> None:
    """A call with no text around it opens no message item; a call cut by max_output_tokens (no finish but
    `length`) ends incomplete; an answer with nothing at all still gets its one empty message item."""
    data = tool_stream([], [("call_a", "get_time", ['{"tz":', '"UT'])], []).replace(b'"tool_calls"}', b'"length"}')
    translator = ResponseEvents(HEADER)
    got = events(translator.feed(data))
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta", *CALL_DONE,
        "response.incomplete"]
    assert got[-1]["response"]["output"] == [{**got[2]["item"], "arguments": '{"tz":"UT', "status": "incomplete"}]
    empty = ResponseEvents(HEADER)
    got = events(empty.feed(tool_stream([], [], [])))
    assert [e["type"] for e in got] == ["response.created", "response.in_progress", *MESSAGE_EVENTS, *MESSAGE_DONE,
                                        "response.completed"]
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == ""
