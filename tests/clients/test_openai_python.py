"""The OpenAI Python SDK, unchanged, against the running gateway: sync, async and streaming, each session
pinned with `x-session-affinity` (conftest.same_worker checks it reached routing)."""
from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest

from tests.clients.conftest import MODEL, SESSION_HEADER, System, same_worker

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name a colour."}]


def test_sync_client(system: System) -> None:
    client = openai.OpenAI(base_url=system.openai_base_url, api_key=system.api_key, max_retries=0,
                           default_headers={SESSION_HEADER: "py-sync"})
    with same_worker(system, 2):
        replies = [client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
                   for _ in range(2)]
    for reply in replies:
        assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
        assert 0 < reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 5
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 4
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    several = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, n=2, seed=3)
    assert [c.index for c in several.choices] == [0, 1] and several.usage.completion_tokens <= 8
    batch = client.completions.create(model=MODEL, prompt=["The sky is", "Grass is"], max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and all(c.text for c in batch.choices)


def test_async_client(system: System) -> None:
    async def ask() -> list[str]:
        client = openai.AsyncOpenAI(base_url=system.openai_base_url, api_key=system.api_key, max_retries=0,
                                    default_headers={SESSION_HEADER: "py-async"})
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=8, temperature=0) for _ in range(3)))
        await client.close()
        return [r.choices[0].message.content or "" for r in replies]

    with same_worker(system, 3):
        texts = asyncio.run(ask())
    assert all(texts)


def test_streaming(system: System) -> None:
    client = openai.OpenAI(base_url=system.openai_base_url, api_key=system.api_key, max_retries=0)
    with same_worker(system, 2):
        for _ in range(2):
            stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_headers={SESSION_HEADER: "py-stream"})
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text
            assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens <= 8
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=system.openai_base_url, api_key="wrong", max_retries=0).chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=2)


def test_responses_api(system: System) -> None:
    """POST /v1/responses, whole and streamed through the SDK's own stream helper, and a refusal."""
    client = openai.OpenAI(base_url=system.openai_base_url, api_key=system.api_key, max_retries=0,
                           default_headers={SESSION_HEADER: "py-responses"})
    with same_worker(system, 2):
        whole = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one word.",
                                        max_output_tokens=8, temperature=0)
        with client.responses.stream(model=MODEL, input=QUESTION, instructions="Answer in one word.",
                                     max_output_tokens=200, temperature=0) as stream:
            deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
            final = stream.get_final_response()
    assert whole.id.startswith("resp_") and whole.output_text and whole.status in ("completed", "incomplete")
    assert whole.usage is not None and whole.usage.input_tokens > 5 and 0 < whole.usage.output_tokens <= 8
    assert final.status == "completed" and final.output_text and "".join(deltas) == final.output_text
    assert final.usage is not None and final.usage.output_tokens > 0
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_0")


def test_json_mode_through_the_gateway(system: System) -> None:
    """response_format json_object on chat and text.format json_object / json_schema on /v1/responses reach the
    workers, whose answers are JSON objects (json.loads is the reference) wherever they end by themselves; a
    schema keyword no provider here follows is a 400 naming the field."""
    client = openai.OpenAI(base_url=system.openai_base_url, api_key=system.api_key, max_retries=0)
    asks = ["Return the capital of France as JSON.", "Give a JSON object with keys a, b and c."]
    texts = []
    for ask in asks:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                              response_format={"type": "json_object"}, max_tokens=120, temperature=0)
        texts.append((chat.choices[0].message.content or "", chat.choices[0].finish_reason == "stop"))
        response = client.responses.create(model=MODEL, input=ask, text={"format": {"type": "json_object"}},
                                           max_output_tokens=120, temperature=0)
        texts.append((response.output_text, response.status == "completed"))
    for text, ended in texts:
        assert text.startswith("{"), text
        if ended:
            assert isinstance(json.loads(text), dict), text
    assert sum(ended for _, ended in texts) >= 1
    schema = {"type": "object", "properties": {"capital": {"type": "string"}, "country": {"enum": ["France"]}},
              "required": ["capital", "country"], "additionalProperties": False}
    followed = client.responses.create(model=MODEL, input=asks[0], max_output_tokens=60, temperature=0, text={
        "format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}})
    assert "".join(followed.output_text.split()).startswith('{"capital"'), followed.output_text   # schema order
    if followed.status == "completed":
        answer = json.loads(followed.output_text)
        assert set(answer) == {"capital", "country"} and answer["country"] == "France", answer
    with pytest.raises(openai.BadRequestError) as refused:   # a keyword the workers do not follow, no provider left
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^x"}}})
    assert refused.value.body["param"] == "response_format"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


class GetWeather(pydantic.BaseModel):
    """Get the current weather in a city."""
    city: str


def test_forced_tool_calls_through_the_gateway(system: System) -> None:
    """tool_choice naming a function or "required" reaches the workers, whose calls the SDK reads (chat, whole and
    streamed; the Responses API's function_call items); the arguments are JSON objects with the required key
    (json.loads is the reference) wherever the answer ended by itself."""
    client = openai.OpenAI(base_url=system.openai_base_url, api_key=system.api_key, max_retries=0)
    named = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=60,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].message.content is None
    if named.choices[0].finish_reason == "stop":
        assert "city" in json.loads(call.function.arguments)
    streamed: list[list[str]] = []      # each call's [name, arguments], as the deltas build it
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=60,
                                                temperature=0, tool_choice="required", stream=True):
        for piece in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            if piece.index == len(streamed):
                streamed.append([piece.function.name, ""])
            streamed[piece.index][1] += piece.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert streamed and {name for name, _ in streamed} == {"get_weather"}, streamed
    if finish == "tool_calls":
        assert all("city" in json.loads(arguments) for _, arguments in streamed), streamed
    # the SDK's own structured tool calls: a pydantic model as the tool, its arguments parsed back into one
    parsed = client.chat.completions.parse(
        model=MODEL, messages=WEATHER_ASK, max_tokens=60, temperature=0,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    weather = parsed.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(weather, GetWeather), weather
    response = client.responses.create(model=MODEL, input="What is the weather like in Paris?", max_output_tokens=60,
                                       temperature=0, tool_choice="required", tools=[
                                           {"type": "function", **WEATHER["function"]}])
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_"), response.output
    if response.status == "completed":
        assert "city" in json.loads(calls[0].arguments)
