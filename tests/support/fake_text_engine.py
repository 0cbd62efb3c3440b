"""The fake upstream's text engine (behaviour `text_engine`, streamed /v1/completions only): an engine whose
next word depends on the text so far, as a real one's does, so a continuation from `prompt + text so far` gives
the undisturbed answer. It is how the gateway's text continuation of several choices is tested
(tests/gateway/test_failover_text.py); it never serves chat.

Sample k of a prompt whose first word is `A` says `A/k/0 A/k/1 ...`, `chunks - k` words, then stops ("stop"),
unless `max_tokens` ends it first ("length"). A prompt that ends with such a word goes on after it (the
sample it names). Choices of a batch with `n` are indexed `prompt_index * n + k`, as OpenAI's and vLLM's are;
events come one word of each running choice in turn, and `reset_after` cuts the connection after that many
events. Usage (with `stream_options.include_usage`) counts words: each prompt once, every word sent.
"""
from __future__ import annotations

import re
from typing import Any

import orjson
from aiohttp import web

from tests.support.fake_upstream_state import FakeState

_LAST_WORD = re.compile(r"(\w+)/(\d+)/(\d+) $")    # a prompt that ends with one of this engine's words


def _samples(prompt: str, n: int, num_words: int, max_tokens: int | None) -> list[list[tuple[str, str | None]]]:
    """Each of `prompt`'s `n` samples: its events' words and finish reasons."""
    stem = re.match(r"\W*(\w+)", prompt)
    name = stem.group(1) if stem else "x"
    resumed = _LAST_WORD.search(prompt)
    starts = [(int(resumed.group(2)), int(resumed.group(3)) + 1)] if resumed else [(k, 0) for k in range(n)]
    out = []
    for k, first in starts:
        end = num_words - k
        if max_tokens is not None:
            end = min(end, first + max_tokens)
        words: list[tuple[str, str | None]] = [(f"{name}/{k}/{j} ", None) for j in range(first, end)]
        if words:
            words[-1] = (words[-1][0], "stop" if end == num_words - k else "length")
        out.append(words)
    return out


async def serve(request: web.Request, state: FakeState, body: dict[str, Any],
                behaviour: dict[str, Any]) -> web.StreamResponse:
    prompt = body.get("prompt", "")
    prompts = prompt if isinstance(prompt, list) else [prompt]
    n = int(body.get("n") or 1)
    choices = [s for p in prompts for s in _samples(p, n, int(behaviour.get("chunks", 3)), body.get("max_tokens"))]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    num_events, reset_after = 0, behaviour.get("reset_after")
    for step in range(max((len(c) for c in choices), default=0)):
        for index, words in enumerate(choices):
            if step >= len(words):
                continue
            if num_events == reset_after:
                request.transport.abort()
                return response
            text, finish = words[step]
            await response.write(_event(state, {"index": index, "text": text, "finish_reason": finish}))
            num_events += 1
    if (body.get("stream_options") or {}).get("include_usage"):
        prompt_words, words_sent = sum(len(p.split()) for p in prompts), sum(len(c) for c in choices)
        await response.write(_event(state, None, {"prompt_tokens": prompt_words, "completion_tokens": words_sent,
                                                  "total_tokens": prompt_words + words_sent}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _event(state: FakeState, choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
    event: dict[str, Any] = {"id": "fake", "object": "text_completion", "served_by": state.name,
                             "choices": [] if choice is None else [choice]}
    if usage is not None:
        event["usage"] = usage
    return b"data: " + orjson.dumps(event) + b"\n\n"
