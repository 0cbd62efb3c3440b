"""Function tools on POST /v1/responses through the real gateway app in one process: the official `openai` SDK
as the client (whole, through its stream helper, and as raw stream events), and the scripted OpenAI-compatible
upstream of tests/gateway/test_anthropic.py answering with tool calls. The translation's tables and stream
properties: tests/gateway/test_responses_translate.py."""
from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.gateway.test_anthropic import (
    CALLS,
    Start,
    _config,
    _openai_sdk,
    start as start,  # the fixture: the gateway app and its upstreams
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": SCHEMA, "strict": False}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": SCHEMA, "strict": False}}
ASKED: Any = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]


def assert_answer(answer: Any) -> None:
    """The upstream's 'Let me check.' and its two calls (CALLS), as a message item and two function_call items."""
    assert answer.status == "completed" and answer.error is None
    assert [item.type for item in answer.output] == ["message", "function_call", "function_call"]
    assert answer.output_text == "Let me check."
    assert [(i.call_id, i.name, json.loads(i.arguments), i.status) for i in answer.output[1:]] == [
        (f"call_{n}", name, arguments, "completed") for n, (name, arguments) in enumerate(CALLS)]
    assert all(i.id.startswith("fc_") for i in answer.output[1:]) and answer.output[1].id != answer.output[2].id
    assert [tool.name for tool in answer.tools] == ["get_weather"]
    assert answer.usage is not None and answer.usage.output_tokens == 2


async def test_function_tools_whole_streamed_and_the_next_turn(start: Start) -> None:
    """The Agents SDK's loop through the gateway: function tools go up in chat form, the upstream's tool calls
    come back as function_call items (whole, accumulated by the SDK's stream helper, and as raw events), and
    the next turn's function_call and function_call_output items go up as tool_calls and tool messages."""
    upstream = await start("openai")
    upstream.calls = CALLS
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    sdk = _openai_sdk(client)
    whole = await sdk.responses.create(model="m", input=ASKED, tools=[WEATHER], parallel_tool_calls=True,
                                       tool_choice={"type": "function", "name": "get_weather"})
    async with sdk.responses.stream(model="m", input=ASKED, tools=[WEATHER]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    raw = [event async for event in await sdk.responses.create(model="m", input=ASKED, tools=[WEATHER],
                                                                stream=True)]
    assert_answer(whole)
    assert_answer(final)
    assert_answer(raw[-1].response)
    assert whole.tool_choice.type == "function" and whole.tool_choice.name == "get_weather"
    assert final.tool_choice == "auto" and final.parallel_tool_calls is True
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert kinds.count("response.function_call_arguments.done") == 2 and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    deltas = [e.delta for e in raw if e.type == "response.function_call_arguments.delta" and e.output_index == 2]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == CALLS[1][1]

    assert upstream.bodies[0]["tools"] == [CHAT_WEATHER] and upstream.bodies[0]["parallel_tool_calls"] is True
    assert upstream.bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert upstream.bodies[1]["tools"] == [CHAT_WEATHER] and upstream.bodies[1]["stream"] is True
    assert "tool_choice" not in upstream.bodies[1] and "parallel_tool_calls" not in upstream.bodies[1]

    upstream.calls = []
    outputs = [{"type": "function_call_output", "call_id": "call_0", "output": "18 C"},
               {"type": "function_call_output", "call_id": "call_1",
                "output": [{"type": "input_text", "text": "no data"}]}]
    turn = await sdk.responses.create(model="m", tools=[WEATHER], input=[
        *ASKED, *(item.model_dump(exclude_unset=True) for item in final.output), *outputs])
    assert turn.output_text == "Hello there" and [i.type for i in turn.output] == ["message"]
    assert upstream.bodies[-1]["messages"] == [
        *ASKED,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Tōkyō","days":[1,2]}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "no data"}]


async def test_tools_other_than_functions_are_refused(start: Start) -> None:
    upstream = await start("openai")
    client = await start(_config({"p": {"kind": "openai", "endpoints": [upstream.url]}}))
    with pytest.raises(openai.BadRequestError) as refused:
        await _openai_sdk(client).responses.create(model="m", input=ASKED, tools=[WEATHER, {"type": "web_search"}])
    assert refused.value.param == "tools[1].type" and "only function tools" in refused.value.message
    assert upstream.bodies == []
