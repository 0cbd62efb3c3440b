"""Broken answers from a single upstream endpoint (issue 11 §2, scenario 2): a connection reset mid-stream,
malformed SSE lines, a stream that ends without [DONE], stalls after the headers or mid-stream, oversized
answers. With one endpoint there is nowhere to fail over to, so what the client gets is the whole story:
the part already sent, then an in-band error event and [DONE]; or, before any byte, an OpenAI-style 502;
never a hung or silently truncated stream. Every request ran once upstream; the gateway survives each.

tests/gateway/test_failover.py covers a broken stream that goes on at a second endpoint, and
tests/gateway/test_streaming.py a reset with failover off; here mid-stream failover is on (the default)
and finds no other endpoint.
"""
from __future__ import annotations

from typing import Any

import pytest

from tests.faults.client import (
    DONE,
    Reply,
    assert_gateway_serves,
    assert_openai_error,
    assert_whole_answer,
    chat,
    content,
    error_event,
    new_request_id,
    post,
    streamed_text,
    whole_text,
)
from tests.faults.conftest import Processes, num_seen
from tests.support.fake_faults import words
from tests.support.gateway_proc import GatewayProcess

FIRST_BYTE_S = 1.0   # the stalling provider's first-byte deadline (the fault under test, not a wait)
TOTAL_S = 5.0        # the `short` provider's whole-leg deadline; its answers' first event comes at once
BIG_BYTES = 8 << 20


class Fleet:
    """`one`: scripted per request; `staller`: sends the headers (when streaming) and then nothing;
    `healthy`: answers. Models: m -> one, short -> one with TOTAL_S, stall -> staller,
    stall_then_ok -> staller then healthy. `keepalive_gateway` sends SSE keepalives every 0.1 s."""

    def __init__(self, procs: Processes) -> None:
        self.one, self.staller, self.healthy = procs.fakes("one", "staller", "healthy")
        self.staller.control(behaviour={"first_chunk_gate": "never"})
        timeouts = {"connect_s": 5.0, "first_byte_s": 30.0, "total_s": 60.0}
        providers: dict[str, Any] = {
            "one": {"endpoints": [self.one.url], "timeouts": timeouts},
            "short": {"endpoints": [self.one.url], "timeouts": {**timeouts, "total_s": TOTAL_S}},
            "staller": {"endpoints": [self.staller.url], "timeouts": {**timeouts, "first_byte_s": FIRST_BYTE_S}},
            "healthy": {"endpoints": [self.healthy.url], "timeouts": timeouts}}
        chains = {"m": ["one"], "short": ["short"], "stall": ["staller"], "stall_then_ok": ["staller", "healthy"]}
        config = {"models": {name: {"providers": chain} for name, chain in chains.items()},
                  "providers": {name: {"kind": "openai", **p} for name, p in providers.items()},
                  "breaker": {"failure_threshold": 1000}, "keepalive_s": 60.0,
                  "retries": {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "budget_min_retries": 1000}}
        self.gateway = procs.gateway(config)
        self.keepalive_gateway = procs.gateway({**config, "keepalive_s": 0.1})

    async def send(self, body: dict[str, Any], gateway: GatewayProcess | None = None) -> tuple[Reply, str]:
        request_id = new_request_id()
        reply = await post((gateway or self.gateway).url, body, headers={"x-request-id": request_id})
        return reply, request_id


@pytest.fixture(scope="module")
def fleet(procs: Processes) -> Fleet:
    return Fleet(procs)


def assert_cut_after(reply: Reply, text: str, max_cut_events: int = 0) -> dict[str, Any]:
    """200, the content events of `text`, at most `max_cut_events` others (the start of an event the upstream
    never finished: failover holds it back, without failover it is closed before what follows), then an
    error event and [DONE]; the error is returned."""
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    events = reply.events
    assert events[-1] == DONE, events[-3:]
    assert streamed_text(reply) == text
    assert len(events) - (text.count(" ") + 2) in range(max_cut_events + 1), events
    error = error_event(events[-2])
    # The code says whether failover was tried (upstream_failed) or not (upstream_stream_failed).
    assert error["type"] == "upstream_error" and "mid-stream" in error["message"], error
    return error


@pytest.mark.parametrize(("fault", "max_cut_events"),
                         [({"reset_after": 2}, 0), ({"fault": "cut_in_event", "at": 2}, 1)],
                         ids=["between-events", "inside-an-event"])
async def test_reset_mid_stream_ends_with_an_error_event(fleet: Fleet, fault: dict[str, Any],
                                                         max_cut_events: int) -> None:
    reply, request_id = await fleet.send(chat("m", True, fake={"chunks": 5, **fault}))
    error = assert_cut_after(reply, words(2), max_cut_events)
    assert fleet.one.url in error["message"]
    assert num_seen(fleet.one, request_id) == 1
    await assert_gateway_serves(fleet.gateway)


MALFORMED = {
    "broken-json": 'data: {"choices": [{"delta": {"content": \n\n',
    "not-a-data-line": "this is not server-sent events\n\n",
    "bad-usage": 'data: {"usage": {"completion_tokens": "many"}, "choices": []}\n\n',
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_lines_are_relayed_and_the_stream_completes(fleet: Fleet, raw: str) -> None:
    # The gateway relays bytes as they come and never parses events: a malformed one reaches the client
    # as sent, between the others, and the stream ends as the upstream ended it.
    reply, request_id = await fleet.send(chat("m", True, fake={"fault": "malformed", "raw": raw, "at": 1}))
    assert_whole_answer(reply, words(3), stream=True)
    assert reply.events[1] == raw.encode().removesuffix(b"\n\n")
    assert [content(e) for e in reply.events] == ["tok0 ", None, "tok1 ", "tok2 ", None]
    assert num_seen(fleet.one, request_id) == 1
    await assert_gateway_serves(fleet.gateway)


@pytest.mark.parametrize("framing", ["chunked", "close"])
async def test_stream_ending_without_done_is_not_silently_truncated(fleet: Fleet, framing: str) -> None:
    reply, request_id = await fleet.send(chat("m", True, fake={"fault": "end_early", "at": 2, "framing": framing}))
    assert num_seen(fleet.one, request_id) == 1
    assert streamed_text(reply) == words(2)
    assert reply.events[-1] == DONE and error_event(reply.events[-2]), reply.events


async def test_stall_mid_stream_is_cut_at_the_total_deadline(fleet: Fleet) -> None:
    reply, request_id = await fleet.send(chat("short", True, fake={"chunks": 4, "chunk_gate": "never-mid"}))
    assert_cut_after(reply, words(1))
    assert num_seen(fleet.one, request_id) == 1
    await assert_gateway_serves(fleet.gateway)


@pytest.mark.parametrize("stream", [False, True], ids=["whole-before-its-headers", "stream-after-its-headers"])
async def test_stall_before_the_first_byte_is_cut_at_the_first_byte_deadline(fleet: Fleet, stream: bool) -> None:
    reply, request_id = await fleet.send(chat("stall", stream))
    error = assert_openai_error(reply, 502, "upstream_failed")
    assert f"{fleet.staller.url}: timeout: no first byte within {FIRST_BYTE_S}s" in error["message"]
    assert num_seen(fleet.staller, request_id) == 1   # one endpoint: nothing to retry on
    await assert_gateway_serves(fleet.gateway)


async def test_stall_after_the_headers_falls_back_to_the_next_provider(fleet: Fleet) -> None:
    reply, request_id = await fleet.send(chat("stall_then_ok", True))
    assert_whole_answer(reply, words(3), stream=True)
    assert (num_seen(fleet.staller, request_id), num_seen(fleet.healthy, request_id)) == (1, 1)
    await assert_gateway_serves(fleet.gateway)


async def test_stall_after_keepalives_ends_with_an_in_band_error(fleet: Fleet) -> None:
    # The client's headers went out with the first keepalive, so the 502 can only come as an event.
    reply, request_id = await fleet.send(chat("stall", True), fleet.keepalive_gateway)
    assert reply.status == 200
    events = reply.events
    assert events[0] == b": keepalive" and set(events[:-2]) == {b": keepalive"}, events
    error = error_event(events[-2])
    assert error["code"] == "upstream_failed" and "no first byte" in error["message"], error
    assert events[-1] == DONE
    assert num_seen(fleet.staller, request_id) == 1
    await assert_gateway_serves(fleet.keepalive_gateway)


BEFORE_ANY_BYTE = {
    "reset-before-the-first-event": ({"reset_after": 0}, True, "connection error"),
    "whole-body-cut": ({"fault": "cut_body"}, False, "connection error: ClientPayloadError"),
    "oversized-error-body": ({"fault": "big_error", "status": 500, "num_bytes": BIG_BYTES}, True, "HTTP 500"),
    "oversized-head": ({"fault": "big_head", "num_bytes": 128 << 10}, False, "UpstreamProtocolError"),
}


@pytest.mark.parametrize(("fault", "stream", "cause"), BEFORE_ANY_BYTE.values(), ids=BEFORE_ANY_BYTE.keys())
async def test_failures_before_any_byte_are_a_clear_502(fleet: Fleet, fault: dict[str, Any], stream: bool,
                                                        cause: str) -> None:
    reply, request_id = await fleet.send(chat("m", stream, fake=fault))
    error = assert_openai_error(reply, 502, "upstream_failed")
    assert cause in error["message"] and len(error["message"]) < 1000, error["message"][:2000]
    assert num_seen(fleet.one, request_id) == 1
    await assert_gateway_serves(fleet.gateway)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_oversized_answers_are_relayed_whole(fleet: Fleet, stream: bool) -> None:
    reply, request_id = await fleet.send(chat("m", stream, fake={"fault": "big_answer", "num_bytes": BIG_BYTES}))
    if stream:
        assert_whole_answer(reply, "x" * BIG_BYTES, stream=True)
        assert len(reply.events) == 2   # one event of 8 MiB, then [DONE]
    else:
        assert reply.status == 200 and whole_text(reply) == "x" * BIG_BYTES
    assert num_seen(fleet.one, request_id) == 1
    await assert_gateway_serves(fleet.gateway)
