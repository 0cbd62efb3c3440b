"""The per-event cost of the Anthropic stream translations (gateway/translate/anthropic/), against the same run's
baseline: `SseCounter.feed`, the per-chunk work the gateway already does on every relayed stream.

    python benchmarks/anthropic_translate_bench.py [--events 200000] [--repeats 5]

Prints microseconds per event (the best of the repeats, so that a busy machine's spikes drop out).
"""
from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

import orjson

from gateway.server.client_stream import SseCounter
from gateway.translate.anthropic.inbound import MessageEvents, MessageHeader
from gateway.translate.anthropic.outbound import ChatChunks

OPENAI_CHUNK = b"data: " + orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
    "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}]}) + b"\n\n"
ANTHROPIC_EVENT = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                   b'"delta":{"type":"text_delta","text":" word"}}\n\n')


def per_event_us(feed: Callable[[], object], num_events: int, repeats: int) -> float:
    return min(timeit.repeat(feed, number=num_events, repeat=repeats)) / num_events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    counter = SseCounter()
    inbound = MessageEvents(MessageHeader("msg_1", "m", ()))
    inbound.feed(OPENAI_CHUNK)   # message_start is behind it: what is timed is the steady state
    outbound = ChatChunks(include_usage=False)
    outbound.feed(b'event: message_start\ndata: {"type":"message_start","message":{"id":"x","model":"m"}}\n\n')
    rows = [
        ("baseline: SseCounter.feed (every relayed chunk)", lambda: counter.feed(OPENAI_CHUNK)),
        ("/v1/messages: OpenAI chunk -> Anthropic event", lambda: inbound.feed(OPENAI_CHUNK)),
        ("anthropic provider: Anthropic event -> OpenAI chunk", lambda: outbound.feed(ANTHROPIC_EVENT)),
    ]
    for name, feed in rows:
        print(f"{name:55s} {per_event_us(feed, args.events, args.repeats):6.2f} us/event")


if __name__ == "__main__":
    main()
