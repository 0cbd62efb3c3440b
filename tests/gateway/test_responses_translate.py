"""OpenAI's Responses API over the chat dispatch (gateway/translate/responses.py, gateway/translate/responses_tools.py):
requests (function tools and tool-call items included) as chat bodies and refusals as tables, and a whole chat
completion as a Response. The stream translator: test_responses_stream.py."""
from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.translate.responses import ResponseHeader, to_chat_body, to_response

HELLO = [{"role": "user", "content": "Hi"}]
REQUEST = {"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5, "metadata": {"k": "v"}}
HEADER = ResponseHeader("resp_1", "msg_1", 1700000000, REQUEST)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": SCHEMA,
           "strict": True}
CLOCK = {"type": "function", "name": "get_time"}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                 "parameters": SCHEMA, "strict": True}}
CHAT_CLOCK = {"type": "function", "function": {"name": "get_time"}}


def function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def function_call_output(call_id: str, output: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


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


JSON_SCHEMA = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}


@pytest.mark.parametrize(("text", "response_format"), [
    ({"format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"format": JSON_SCHEMA, "verbosity": "low"},
     {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}),
    ({"format": {**JSON_SCHEMA, "description": "A city", "strict": None}},
     {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "description": "A city"}}),
])
def test_structured_output_becomes_a_response_format(text: dict[str, Any], response_format: dict[str, Any]) -> None:
    """JSON mode is served by switchyard workers; a schema goes to a provider that follows schemas."""
    request = {"model": "m", "input": "Hi", "text": text}
    assert to_chat_body(request) == {"model": "m", "messages": HELLO, "response_format": response_format}
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "{}"}, "finish_reason": "stop"}]}
    assert to_response(completion, ResponseHeader("resp_1", "msg_1", 0, request))["text"] == {"format": text["format"]}
    assert to_response(completion, HEADER)["text"] == {"format": {"type": "text"}}


@pytest.mark.parametrize(("fields", "chat"), [
    ({"tools": [WEATHER, CLOCK]}, {"tools": [CHAT_WEATHER, CHAT_CLOCK]}),
    ({"tools": [WEATHER], "tool_choice": "auto"}, {"tools": [CHAT_WEATHER], "tool_choice": "auto"}),
    ({"tools": [WEATHER], "tool_choice": "required"}, {"tools": [CHAT_WEATHER], "tool_choice": "required"}),
    ({"tools": [WEATHER], "tool_choice": "none"}, {"tools": [CHAT_WEATHER], "tool_choice": "none"}),
    ({"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "name": "get_time"}, "parallel_tool_calls": False},
     {"tools": [CHAT_WEATHER, CHAT_CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "parallel_tool_calls": False}),
    ({"tools": [WEATHER], "parallel_tool_calls": True}, {"tools": [CHAT_WEATHER], "parallel_tool_calls": True}),
    ({"tools": [{**CLOCK, "description": None, "parameters": None, "strict": None}]}, {"tools": [CHAT_CLOCK]}),
    # no tools: nothing about them goes up (a chat upstream may refuse tool_choice without tools)
    ({"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}, {}),
    ({"tool_choice": "none"}, {}),
])
def test_function_tools_become_chat_tools(fields: dict[str, Any], chat: dict[str, Any]) -> None:
    assert to_chat_body({"model": "m", "input": "Hi", **fields}) == {"model": "m", "messages": HELLO, **chat}


USER = {"role": "user", "content": "Hi"}
PARIS = chat_call("call_0", "get_weather", '{"city":"Paris"}')
TIME = chat_call("call_1", "get_time", "{}")


@pytest.mark.parametrize(("items", "messages"), [
    # the SDK's round trip: a previous answer's output items (its message, then its calls), then their outputs
    ([USER, {"type": "message", "id": "msg_0", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
      {**function_call("call_0", "get_weather", '{"city":"Paris"}'), "id": "fc_0", "status": "completed"},
      function_call("call_1", "get_time", "{}"),
      function_call_output("call_0", "18 C"),
      function_call_output("call_1", [{"type": "input_text", "text": "12:00"}, {"type": "input_text", "text": "UTC"}])],
     [USER, {"role": "assistant", "content": "Let me check.", "tool_calls": [PARIS, TIME]},
      {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
      {"role": "tool", "tool_call_id": "call_1", "content": "12:00\nUTC"}]),
    # calls alone, one turn after another; Codex's reasoning items are skipped
    ([USER, {"type": "reasoning", "id": "rs_0", "summary": [], "encrypted_content": "e"},
      function_call("call_0", "get_weather", '{"city":"Paris"}'), function_call_output("call_0", "18 C"),
      {"type": "reasoning", "id": "rs_1", "summary": []},
      function_call("call_1", "get_time", "{}"), function_call_output("call_1", "12:00"),
      {"role": "user", "content": "Thanks"}],
     [USER, {"role": "assistant", "content": None, "tool_calls": [PARIS]},
      {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
      {"role": "assistant", "content": None, "tool_calls": [TIME]},
      {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}, {"role": "user", "content": "Thanks"}]),
    # an empty assistant text before the calls is no content; a user message between calls parts them
    ([USER, {"role": "assistant", "content": ""}, function_call("call_0", "get_weather", '{"city":"Paris"}'),
      USER, function_call("call_1", "get_time", "{}"),
      function_call_output("call_1", "12:00"), function_call_output("call_0", "18 C")],
     [USER, {"role": "assistant", "content": None, "tool_calls": [PARIS]}, USER,
      {"role": "assistant", "content": None, "tool_calls": [TIME]},
      {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
      {"role": "tool", "tool_call_id": "call_0", "content": "18 C"}]),
])
def test_function_call_items_become_chat_messages(items: list[dict[str, Any]], messages: list[dict[str, Any]]) -> None:
    body = {"model": "m", "input": items, "tools": [WEATHER, CLOCK]}
    assert to_chat_body(body) == {"model": "m", "messages": messages, "tools": [CHAT_WEATHER, CHAT_CLOCK]}


@pytest.mark.parametrize(("body", "param"), [
    ([], None),
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_0"}, "previous_response_id"),
    ({"model": "m", "input": "x", "conversation": "conv_0"}, "conversation"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    # values of the wrong JSON type where a name is expected: a 400, not a TypeError (found by the fuzzer)
    ({"model": "m", "input": [{"type": "message", "role": "user", "content": [{"type": [1], "text": "x"}]}]},
     "input[0].content[0]"),
    ({"model": "m", "input": [{"type": "message", "role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0]"),
    ({"model": "m", "input": "x", "tools": [CLOCK], "tool_choice": {"type": "function", "name": ["get_time"]}},
     "tool_choice.name"),
    ({"model": "m", "input": "x", "text": {"format": "json"}}, "text.format"),
    ({"model": "m", "input": "x", "instructions": 3}, "instructions"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "fc_0"}]}, "input[0]"),
    ({"model": "m", "input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"model": "m", "input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"model": "m", "input": "x", "tools": {"type": "function", "name": "f"}}, "tools"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tools": [WEATHER, {"type": "custom", "name": "apply_patch"}]}, "tools[1].type"),
    ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tools": ["f"]}, "tools[0]"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
     "tools[0].parameters"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "description": 1}]},
     "tools[0].description"),
    ({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
     "tool_choice.name"),
    ({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
    ({"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"model": "m", "input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"model": "m", "input": "x", "tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"model": "m", "input": [function_call_output("c", "o")]}, "input[0].call_id"),   # no call before it
    ({"model": "m", "input": [function_call("c", "f", "{}"), function_call_output("d", "o")]}, "input[1].call_id"),
    ({"model": "m", "input": [function_call("c", "f", "{}"), function_call_output("c", 3)]}, "input[1].output"),
    ({"model": "m", "input": [function_call("c", "f", "{}"),
                              function_call_output("c", [{"type": "input_image", "image_url": "u"}])]},
     "input[1].output[0]"),
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


def test_whole_answer_with_tool_calls_to_response() -> None:
    request = {"model": "m", "input": "Hi", "tools": [WEATHER, CLOCK], "tool_choice": "required",
               "parallel_tool_calls": False}
    header = ResponseHeader("resp_2", "msg_2", 1700000000, request)
    message = {"role": "assistant", "content": "Let me check.", "tool_calls": [PARIS, TIME]}
    completion = {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                  "usage": {"prompt_tokens": 9, "completion_tokens": 5}}
    response = to_response(completion, header)
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert (response["tools"], response["tool_choice"], response["parallel_tool_calls"]) == (
        [WEATHER, CLOCK], "required", False)
    text, *calls = response["output"]
    assert text == {"type": "message", "id": "msg_2", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]}
    assert [{k: v for k, v in c.items() if k != "id"} for c in calls] == [
        {"type": "function_call", "call_id": "call_0", "name": "get_weather", "arguments": '{"city":"Paris"}',
         "status": "completed"},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}", "status": "completed"}]
    assert all(c["id"].startswith("fc_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # tool calls alone: no message item; cut by max_output_tokens: the last item is incomplete
    completion["choices"][0].update(message={**message, "content": None}, finish_reason="length")
    response = to_response(completion, header)
    assert [(i["type"], i["status"]) for i in response["output"]] == [
        ("function_call", "completed"), ("function_call", "incomplete")]
    assert response["status"] == "incomplete"
    # a request without tools echoes OpenAI's defaults
    plain = to_response({"choices": [{"message": {"content": ""}, "finish_reason": "stop"}]}, HEADER)
    assert (plain["tools"], plain["tool_choice"], plain["parallel_tool_calls"]) == ([], "auto", True)
    assert [i["type"] for i in plain["output"]] == ["message"]
