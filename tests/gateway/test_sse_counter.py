"""gateway/streaming.py: counting content events and usage in an SSE stream cut at any byte."""
from __future__ import annotations

from gateway.streaming import SseCounter


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
