"""gateway/server/client_stream.py: counting content events and usage in an SSE stream cut at any byte."""
from __future__ import annotations

import itertools
import re

import orjson
from hypothesis import given, settings, strategies as st

from gateway.server.client_stream import SseCounter


def test_sse_counter_counts_content_events_across_chunk_boundaries() -> None:
    counter = SseCounter()
    stream = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
              b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
              b': keepalive\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9,'
              b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
              b'data: [DONE]\n\n')
    counts = [counter.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)]
    assert sum(counts) == 2
    assert (counter.usage.num_output_tokens, counter.usage.num_prompt_tokens, counter.usage.num_cached_tokens) == \
        (9, 5, 4)
    assert not counter.mid_event
    counter.feed(b'data: {"cho')
    assert counter.mid_event


def reference_count(stream: bytes) -> tuple[int, int | None, int | None, int]:
    """(content events, usage's completion, prompt and cached tokens) by the rule, on the whole stream at once:
    events are what lies between blank lines (a run of them separates once, and the stream's leading ones
    separate nothing, as SSE parses it); a content
    event is one that begins with a `data:` line and is neither [DONE] nor usage-only (a usage object and no
    choices)."""
    num_events, completion, prompt, cached = 0, None, None, 0
    for event in re.split(b"\n\n+", stream.lstrip(b"\n"))[:-1]:
        if not event.startswith(b"data:") or event.startswith(b"data: [DONE]"):
            continue
        try:
            payload = orjson.loads(event[5:])
        except orjson.JSONDecodeError:
            payload = None
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict):
            completion, prompt = usage.get("completion_tokens", completion), usage.get("prompt_tokens", prompt)
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", cached)
            if not payload.get("choices"):
                continue
        num_events += 1
    return num_events, completion, prompt, cached


EVENTS = [
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"the \\"usage\\" word"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"b"}}],"usage":null}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9,"prompt_tokens_details":'
    b'{"cached_tokens":4}}}\n\n',
    b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":6,"completion_tokens":2}}\n\n',
    b': keepalive\n\n',
    b'event: ping\ndata: {"choices":[{"delta":{"content":"c"}}]}\n\n',
    b'data: not json, "usage" here\n\n',
    b'data {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1}}\n\n',   # not a data: event
    b'data: [DONE]\n\n',
    b'\n',              # a stray newline: a run of three next to a separator
    b'data:{"choices":[{"delta":{"content":"d"}}]}\n\n',
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), max_size=30), st.lists(st.integers(0, 4_000), max_size=20))
def test_counts_equal_the_whole_stream_rule_however_it_is_cut(events: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(events)
    bounds = [0, *sorted({c % (len(stream) + 1) for c in cuts}), len(stream)]
    counter = SseCounter()
    counted = sum(counter.feed(stream[a:b]) for a, b in itertools.pairwise(bounds) if b > a)
    num_events, completion, prompt, cached = reference_count(stream)
    assert counted == num_events
    usage = counter.usage
    assert usage.num_output_tokens == (completion if completion is not None else num_events)
    assert (usage.num_prompt_tokens, usage.num_cached_tokens) == (prompt, cached)
    assert counter.mid_event == bool(stream.split(b"\n\n")[-1].strip())
