"""Forced tool calls on a real worker (bundled SmolLM2, fp32 CPU): `tool_choice` naming a function or "required"
answers `tool_calls` whose arguments follow the tools' parameter schemas (the reference validator of
tests/backends/structured_output/test_json_schema.py and `json.loads` judge them), whole and streamed alike, each of n
choices; a conversation with calls and their results goes on; what the worker cannot honour is refused and
leaks nothing."""
from __future__ import annotations

import json
from typing import Any

import aiohttp
import orjson
import pytest

from tests.backends.server.worker_client import post, wait_idle
from tests.backends.structured_output.test_json_schema import valid
from tests.support.worker_proc import WorkerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
                   "$defs": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 96


@pytest.fixture
def worker_url(structured_worker: WorkerProcess) -> str:
    return structured_worker.url


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "messages": ASK, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0,
            **fields}


def check_calls(message: dict[str, Any], finish: str, done: str) -> list[tuple[str, Any]]:
    """Each call's (name, arguments): a known function's, its arguments valid under its parameters when the
    answer ended by itself (`done`: the finish reason then)."""
    assert message["role"] == "assistant" and message["content"] is None, message
    calls = message["tool_calls"]
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls), calls
    assert len({c["id"] for c in calls}) == len(calls)
    assert finish in (done, "length"), finish
    out = []
    for call in calls:
        name, text = call["function"]["name"], call["function"]["arguments"]
        assert name in SCHEMAS, name
        if finish == done:
            arguments = json.loads(text)
            assert valid(arguments, SCHEMAS[name], SCHEMAS[name]), (name, arguments)
            out.append((name, arguments))
    return out


async def streamed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The message a client assembles from the stream's deltas (as the OpenAI SDKs do), with the stream's token
    ids, and its finish reason."""
    message: dict[str, Any] = {"role": None, "content": None, "tool_calls": [], "token_ids": []}
    finish = ""
    async with session.post(f"{url}/v1/chat/completions",
                            json={**body, "stream": True, "return_token_ids": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            message["role"] = delta.get("role", message["role"])
            assert delta.get("content") is None, delta
            for piece in delta.get("tool_calls") or ():
                calls = message["tool_calls"]
                if piece["index"] == len(calls):
                    calls.append({"id": piece["id"], "type": piece["type"],
                                  "function": {"name": piece["function"]["name"], "arguments": ""}})
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
            message["token_ids"] += choice["token_ids"]
            finish = choice["finish_reason"] or finish
    return message, finish


def assert_alike(message: dict[str, Any], finish: str, choice: dict[str, Any], done: str) -> None:
    """A streamed answer is valid on its own; where its tokens are the whole answer's (the prompt's KV came from
    the prefix cache the second time: float32 rounding may break a near tie either way), so are its calls."""
    check_calls(message, finish, done)
    if message["token_ids"] == choice["token_ids"]:
        assert finish == choice["finish_reason"]
        assert [c["function"] for c in message["tool_calls"]] == \
            [c["function"] for c in choice["message"]["tool_calls"]]


async def test_a_named_function_is_called_with_valid_arguments(worker_url: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, f"{worker_url}/v1/chat/completions",
                                  chat(tool_choice=named, return_token_ids=True))
        assert status == 200, body
        choice = body["choices"][0]
        calls = check_calls(choice["message"], choice["finish_reason"], "stop")
        assert [name for name, _ in calls] in ([], ["get_weather"])
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert_alike(*await streamed(session, worker_url, chat(tool_choice=named)), choice, "stop")
        status, sampled = await post(session, f"{worker_url}/v1/chat/completions",
                                     chat(tool_choice=named, temperature=1.0, seed=3, n=3))
        assert status == 200, sampled
        ended = sum(bool(check_calls(c["message"], c["finish_reason"], "stop")) for c in sampled["choices"])
        assert ended + (choice["finish_reason"] == "stop") >= 1   # the constraint lets answers end, too
        await wait_idle(session, worker_url)


async def test_required_calls_one_or_more_tools(worker_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, f"{worker_url}/v1/chat/completions",
                                  chat(tool_choice="required", return_token_ids=True))
        assert status == 200, body
        choice = body["choices"][0]
        check_calls(choice["message"], choice["finish_reason"], "tool_calls")
        assert_alike(*await streamed(session, worker_url, chat(tool_choice="required")), choice, "tool_calls")
        status, single = await post(session, f"{worker_url}/v1/chat/completions",
                                    chat(tool_choice="required", parallel_tool_calls=False))
        assert status == 200 and len(single["choices"][0]["message"]["tool_calls"]) == 1, single
        # without tools the same question is answered in prose: the calls above are the constraint's doing
        status, plain = await post(session, f"{worker_url}/v1/chat/completions",
                                   {k: v for k, v in chat().items() if k != "tools"})
        assert status == 200 and not plain["choices"][0]["message"]["content"].lstrip().startswith("[")
        await wait_idle(session, worker_url)


async def test_a_conversation_goes_on_after_a_call_and_what_is_refused_leaks_nothing(worker_url: str) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, f"{worker_url}/v1/chat/completions",
                                  chat(messages=history, tool_choice="none", max_tokens=8))
        assert status == 200 and isinstance(body["choices"][0]["message"]["content"], str), body
        for fields, param in (({"tool_choice": "auto"}, "tool_choice"),
                              ({"tool_choice": "required", "kv_transfer_params": {"do_remote_decode": True}},
                               "kv_transfer_params")):
            status, refused = await post(session, f"{worker_url}/v1/chat/completions", chat(**fields))
            assert status == 400 and refused["error"]["param"] == param, refused
        # A call resumes (mid-stream failover) from tokens that begin it, and from no others.
        status, refused = await post(session, f"{worker_url}/v1/chat/completions",
                                     chat(tool_choice="required", resume_token_ids=[1, 2]))
        assert status == 400, refused
        await wait_idle(session, worker_url)
