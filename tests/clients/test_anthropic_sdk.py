"""The official `anthropic` Python SDK, unchanged, against the gateway's POST /v1/messages with real workers
behind it: whole and streamed messages, a system prompt, prefix-cache reads in usage, stop sequences and
errors in Anthropic's shape. Sessions are pinned with `x-session-affinity` as for the OpenAI clients."""
from __future__ import annotations

import urllib.request

import anthropic
import orjson
import pytest
from anthropic.types import Message

from tests.clients.conftest import MODEL, SESSION_HEADER, System, same_worker

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# transformers' greedy answer, "The capital of Japan is Tokyo.", leads its runner-up by at least 0.97 at every
# token in float32 and in bf16, so rounding cannot swap it for one without an "e" (for France, "The" leads
# "Paris." by 0.08).
JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]
GREEDY = {"temperature": 0}   # Anthropic's default is 1.0, and SDK 2.x takes it only in the body


def client(system: System, session: str | None = None, api_key: str | None = None) -> anthropic.Anthropic:
    headers = {SESSION_HEADER: session} if session else None
    return anthropic.Anthropic(base_url=system.gateway_url, api_key=api_key or system.api_key, max_retries=0,
                               default_headers=headers)


def test_message_and_stream(system: System) -> None:
    sdk = client(system, "anthropic-basic")
    with same_worker(system, 2):
        message = sdk.messages.create(model=MODEL, max_tokens=12, system="You are a geography teacher.",
                                      messages=QUESTION)
        with sdk.messages.stream(model=MODEL, max_tokens=12, system="You are a geography teacher.",
                                 messages=QUESTION) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.input_tokens > 5 and 0 < message.usage.output_tokens <= 12
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text and final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= 12
    # input tokens as Anthropic counts them: the uncached part plus the cache reads is the whole prompt
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_a_repeated_long_prompt_reads_the_prefix_cache(system: System) -> None:
    sdk = client(system, "anthropic-cache")
    system_prompt = "You are a concise assistant for a railway company. " * 8   # several full KV blocks
    messages = [{"role": "user", "content": "Hello!"}]
    with same_worker(system, 2):
        first = sdk.messages.create(model=MODEL, max_tokens=4, system=system_prompt, messages=messages)
        second = sdk.messages.create(model=MODEL, max_tokens=4, system=system_prompt, messages=messages)
    assert second.usage.cache_read_input_tokens is not None and second.usage.cache_read_input_tokens >= 16 * 4
    assert second.usage.cache_creation_input_tokens == 0
    total = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    with sdk.messages.stream(model=MODEL, max_tokens=4, system=system_prompt, messages=messages) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.cache_read_input_tokens is not None and streamed.usage.cache_read_input_tokens >= 16 * 4


def test_stop_sequences(system: System) -> None:
    sdk = client(system, "anthropic-stop")
    message = sdk.messages.create(model=MODEL, max_tokens=48, messages=JAPAN, extra_body=GREEDY,
                                  stop_sequences=["e", "zzz"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "e")
    assert message.content[0].text == "Th"    # cut inside the answer's first token
    with sdk.messages.stream(model=MODEL, max_tokens=48, messages=JAPAN, extra_body=GREEDY,
                             stop_sequences=["e"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "e")
    assert final.content[0].text == "Th"


def test_count_tokens_is_the_prompt_a_worker_takes(system: System) -> None:
    """messages.count_tokens against what a worker (transformers' chat template) counts for the same chat, a
    prefilled answer included; no request reaches a worker for the count itself."""
    sdk = client(system)
    teacher = "You are a geography teacher."
    before = system.finished_sequences()
    for messages in (QUESTION, [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]):
        counted = sdk.messages.count_tokens(model=MODEL, system=teacher, messages=messages)
        chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "system", "content": teacher}, *messages],
                **({"continue_final_message": True} if messages[-1]["role"] == "assistant" else {})}
        request = urllib.request.Request(system.worker_urls[0] + "/v1/chat/completions", data=orjson.dumps(chat),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert counted.input_tokens == orjson.loads(response.read())["usage"]["prompt_tokens"]
    assert sum(system.finished_sequences()) - sum(before) == 2     # only the two direct requests ran
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.count_tokens(model="no-such-model", messages=QUESTION)


def test_errors_in_anthropics_shape(system: System) -> None:
    sdk = client(system)
    with pytest.raises(anthropic.BadRequestError) as missing:
        sdk.post("/v1/messages", body={"model": MODEL, "messages": QUESTION}, cast_to=Message)   # no max_tokens
    assert missing.value.status_code == 400
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        client(system, api_key="wrong").messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    assert bad_key.value.status_code == 401 and bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    assert unknown.value.body["error"]["type"] == "not_found_error"


def test_a_forced_tool_use(system: System) -> None:
    """tool_choice naming a tool reaches a worker, which calls it: a tool_use block whose input the SDK reads as
    an object holding the required key when the answer ended by itself; streamed, as input_json_delta pieces."""
    client = anthropic.Anthropic(base_url=system.gateway_url, api_key=system.api_key, max_retries=0)
    tool = {"name": "get_weather", "description": "Get the current weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    message = client.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[tool],
                                     tool_choice={"type": "tool", "name": "get_weather"})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id, message.content
    if message.stop_reason == "tool_use":
        assert "city" in uses[0].input
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[tool],
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert streamed and streamed[0].name == "get_weather", final.content
    if final.stop_reason == "tool_use":
        assert all("city" in block.input for block in streamed)
