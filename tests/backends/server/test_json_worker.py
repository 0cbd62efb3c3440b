"""JSON mode (`response_format: {"type": "json_object"}`) on a real worker (bundled SmolLM2, fp32 CPU). Python's
`json.loads` is the reference: every answer that ends by itself is one JSON object, whole and streamed, each
of n choices, greedy and sampled, after a resumed start; what the worker cannot honour is a 400."""
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

JSON = {"type": "json_object"}
ASKS = ["Describe a cat as JSON with its name and age.",
        "Give me a JSON object listing three fruits and their colours.",
        "Return the capital of France as JSON.",
        "Output a JSON object with keys a, b and c set to 1, 2 and 3."]
MAX_TOKENS = 160


@pytest.fixture
def worker_url(structured_worker: WorkerProcess) -> str:
    return structured_worker.url


def test_the_vocabulary_tries_are_built_before_the_worker_serves(structured_worker: WorkerProcess) -> None:
    """Built on a first structured request, on the engine's step thread, they stalled every running stream
    (benchmarks/structured_first_request.py: 318 ms against 39 ms for a plain request arriving); at start-up
    they cost no stream anything."""
    lines = structured_worker.log().splitlines()
    built = next(i for i, line in enumerate(lines) if "structured-output vocabulary tries built" in line)
    serving = next(i for i, line in enumerate(lines) if "serving on http://" in line)
    assert built < serving, lines


def chat(ask: str, **fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "messages": [{"role": "user", "content": ask}], "max_tokens": MAX_TOKENS,
            "response_format": JSON, "temperature": 0, **fields}


def check_object(text: str, finish: str | None) -> bool:
    """A finished answer is one JSON object; one cut by max_tokens is at least begun as one. True: finished."""
    assert text.startswith("{"), text
    if finish == "stop":
        assert isinstance(json.loads(text), dict) and text.endswith("}"), text   # no padding after it
        return True
    assert finish == "length", finish
    return False


async def test_every_answer_is_one_json_object(worker_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        finished = 0
        for ask in ASKS:
            for fields in ({}, {"temperature": 1.0, "seed": 7, "n": 3}):
                status, body = await post(session, f"{worker_url}/v1/chat/completions", chat(ask, **fields))
                assert status == 200, body
                for choice in body["choices"]:
                    finished += check_object(choice["message"]["content"], choice["finish_reason"])
        # the constraint must also let answers end: on this machine 9 of the 16 objects close inside MAX_TOKENS
        # (the others ramble on, as a 135M model does); a quarter leaves room for other CPUs' rounding
        assert finished >= len(ASKS) * 4 // 4
        # the same without the constraint is no JSON at all: the test above is not passed by the model alone
        status, plain = await post(session, f"{worker_url}/v1/chat/completions",
                                   {**chat(ASKS[0]), "response_format": {"type": "text"}})
        assert status == 200 and not plain["choices"][0]["message"]["content"].startswith("{")
        await wait_idle(session, worker_url)


async def test_a_streamed_json_answer(worker_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        text, finish = "", None
        async with session.post(f"{worker_url}/v1/chat/completions", json=chat(ASKS[3], stream=True)) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    choice = orjson.loads(line[6:])["choices"][0]
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
        status, whole = await post(session, f"{worker_url}/v1/chat/completions", chat(ASKS[3]))
        assert status == 200 and text == whole["choices"][0]["message"]["content"]
        check_object(text, finish)


async def test_a_resumed_answer_goes_on_as_json(worker_url: str) -> None:
    """resume_token_ids (the gateway's failover, and a decode leg's first tokens) restart the recognizer
    after the tokens already out; a start that is no JSON object is refused."""
    async with aiohttp.ClientSession() as session:
        status, first = await post(session, f"{worker_url}/v1/chat/completions",
                                   chat(ASKS[1], max_tokens=6, return_token_ids=True))
        assert status == 200
        done = first["choices"][0]["token_ids"]
        status, rest = await post(session, f"{worker_url}/v1/chat/completions",
                                  chat(ASKS[1], resume_token_ids=done, return_token_ids=True))
        assert status == 200, rest
        choice = rest["choices"][0]
        check_object(first["choices"][0]["message"]["content"] + choice["message"]["content"], choice["finish_reason"])
        status, error = await post(session, f"{worker_url}/v1/completions",
                                   {"model": "smollm2", "prompt": "Hi", "max_tokens": 8, "response_format": JSON,
                                    "resume_token_ids": [28, 28]})
        assert status == 400, error
        await wait_idle(session, worker_url)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "pet": {"enum": ["cat", "dog", "none"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}, "email": {"type": ["string", "null"]}},
    "required": ["name", "age", "pet"], "additionalProperties": False}


async def test_answers_follow_a_json_schema(worker_url: str) -> None:
    """response_format json_schema: each answer that ends by itself validates against the schema (checked by
    tests/backends/structured_output/test_json_schema.py's own validator, not by the grammar); a JSON schema in
    /v1/completions too."""
    format_ = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    async with aiohttp.ClientSession() as session:
        finished = 0
        for ask in ("Describe a person as JSON.", "Invent a character for a story."):
            for fields in ({}, {"temperature": 1.0, "seed": 11, "n": 2}):
                status, body = await post(session, f"{worker_url}/v1/chat/completions",
                                          {**chat(ask, **fields), "response_format": format_})
                assert status == 200, body
                for choice in body["choices"]:
                    text = choice["message"]["content"]
                    assert text.startswith("{"), text
                    if choice["finish_reason"] == "stop":
                        assert valid(json.loads(text), PERSON, PERSON) and text.endswith("}"), text
                        finished += 1
        assert finished >= 2
        status, body = await post(session, f"{worker_url}/v1/completions",
                                  {"model": "smollm2", "prompt": "A colour as JSON:", "max_tokens": 40,
                                   "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                                       "name": "c", "schema": {"enum": ["red", "green", "blue"]}}}})
        assert status == 200 and json.loads(body["choices"][0]["text"]) in ("red", "green", "blue"), body
        await wait_idle(session, worker_url)


@pytest.mark.parametrize(("fields", "status", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 3}}}}, 400, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, 400,
     "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, 400, "response_format"),
    ({"ignore_eos": True}, 400, "response_format"),
    ({"min_tokens": 4}, 400, "response_format"),
])
async def test_what_json_mode_cannot_honour(worker_url: str, fields: dict[str, Any], status: int, param: str) -> None:
    async with aiohttp.ClientSession() as session:
        got, body = await post(session, f"{worker_url}/v1/chat/completions", {**chat(ASKS[0]), **fields})
        assert got == status and body["error"]["param"] == param, body
        if "minLength" in str(fields):   # what the gateway hands to a provider that follows the schema
            assert body["error"]["code"] == "unsupported_parameter" and "minLength" in body["error"]["message"]
