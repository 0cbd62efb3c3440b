"""The `anthropic` provider kind: OpenAI chat requests falling back to a fake Anthropic API, its errors retried or
relayed, and /v1/messages passed through it. The app, the scripted upstreams and the fixture are test_anthropic.py's."""
from __future__ import annotations

import openai
import pytest

from tests.gateway.test_anthropic import (
    HELLO,
    Start,
    _config,
    _openai_sdk,
    _sdk,
    start,  # noqa: F401  (the fixture)
)

# --- the `anthropic` provider kind -------------------------------------------------------------------

async def test_chat_falls_back_to_an_anthropic_upstream(start: Start) -> None:  # noqa: F811
    down, claude = await start("openai"), await start("anthropic")
    client = await start(_config({"down": {"kind": "openai", "endpoints": [down.url]},
                                  "claude": {"kind": "anthropic", "endpoints": [claude.url], "api_key": "sk-ant",
                                             "upstream_model": "claude-x", "health_path": None}}))
    down.answers = [(503, "busy")] * 100
    sdk = _openai_sdk(client)
    reply = await sdk.chat.completions.create(
        model="m", max_tokens=30, temperature=1.5, stop="\n\n",
        messages=[{"role": "system", "content": "Be French."}, {"role": "user", "content": "Hello"}])
    assert reply.choices[0].message.content == "Bonjour toi" and reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (37, 2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 32
    assert claude.bodies[-1] == {"model": "claude-x", "max_tokens": 30, "temperature": 1.0, "system": "Be French.",
                                 "stop_sequences": ["\n\n"], "messages": [{"role": "user", "content": "Hello"}]}
    headers = claude.headers[-1]
    assert headers["x-api-key"] == "sk-ant" and headers["anthropic-version"] == "2023-06-01"
    assert "Authorization" not in headers

    stream = await sdk.chat.completions.create(model="m", max_tokens=30, messages=HELLO, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Bonjour toi"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    assert claude.bodies[-1]["stream"] is True


async def test_anthropic_upstream_errors_are_retried_or_relayed(start: Start) -> None:  # noqa: F811
    first, second = await start("anthropic"), await start("anthropic")
    client = await start(_config({"claude": {"kind": "anthropic", "endpoints": [first.url, second.url],
                                             "health_path": None}}))
    sdk = _openai_sdk(client)
    first.answers = [(529, "overloaded_error")]     # round robin: the first request tries `first` first
    reply = await sdk.chat.completions.create(model="m", max_tokens=5, messages=HELLO)
    assert reply.choices[0].message.content == "Bonjour toi" and len(first.bodies) == len(second.bodies) == 1
    second.stream_error = "overloaded_error"        # a 200 that opens with an error event: nothing sent yet
    stream = await sdk.chat.completions.create(model="m", max_tokens=5, messages=HELLO, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "Bonjour toi"
    first.answers, second.answers = [(400, "invalid_request_error")], [(400, "invalid_request_error")]
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model="m", max_tokens=5, messages=HELLO)
    assert caught.value.body["message"] == "scripted 400" and caught.value.body["code"] == "invalid_request_error"
    # what has no Messages API form is handed on; here to nothing, so the request itself is what no provider
    # serves: a 400, not a 503
    with pytest.raises(openai.BadRequestError) as untranslatable:
        await sdk.chat.completions.create(model="m", max_tokens=5, messages=[{"role": "tool", "content": "x"}])
    assert "no Messages API form" in str(untranslatable.value.message)


async def test_messages_through_an_anthropic_upstream(start: Start) -> None:  # noqa: F811
    """Both translations in a row: Anthropic in, OpenAI dispatch, Anthropic out and back."""
    claude = await start("anthropic")
    client = await start(_config({"claude": {"kind": "anthropic", "endpoints": [claude.url], "health_path": None}}))
    sdk = _sdk(client)
    message = await sdk.messages.create(model="m", max_tokens=9, system="S", messages=HELLO, stop_sequences=["x"])
    assert message.content[0].text == "Bonjour toi" and message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (5, 32)
    assert claude.bodies[-1] == {"model": "m", "max_tokens": 9, "system": "S", "stop_sequences": ["x"],
                                 "messages": HELLO}
    async with sdk.messages.stream(model="m", max_tokens=9, messages=HELLO) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == "Bonjour toi" and final.stop_reason == "max_tokens"
    assert (final.usage.output_tokens, final.usage.cache_read_input_tokens) == (2, 32)
