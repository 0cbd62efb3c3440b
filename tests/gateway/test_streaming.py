"""Relay through a real gateway process to fake upstream processes: SSE chunk by chunk, keepalives
during a stall, non-streaming relay with the model renamed, request ids, mid-stream failure."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from tests.gateway.conftest import gateway_config, metric
from tests.support.wait import await_until

CHAT = "/v1/chat/completions"


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}


async def read_events(response: aiohttp.ClientResponse,
                      on_event: Callable[[bytes], None] | None = None) -> list[bytes]:
    """Every SSE event or comment, as the client sees them; `on_event` runs as each one arrives."""
    events: list[bytes] = []
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            events.append(event)
            if on_event is not None:
                on_event(event)
    return events


@pytest.fixture
def one_upstream(start_fakes, start_gateway):
    (fake,) = start_fakes("a")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, keepalive_s=0.2))
    return fake, gateway


async def test_stream_is_relayed_chunk_by_chunk(one_upstream) -> None:
    fake, gateway = one_upstream
    # The upstream sends chunk i+1 only once chunk i has reached the client: a gateway that held
    # chunks back would never see the next one, and the stream would end in a timeout instead.
    body = chat_body(stream=True, fake={"chunks": 4, "chunk_gate": "next"})

    def release_next(event: bytes) -> None:
        if event.startswith(b"data: {"):
            fake.release("next")

    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = await read_events(response, release_next)
    data = [e for e in events if e.startswith(b"data: {")]
    assert [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in data] == [f"tok{i} " for i in range(4)]
    assert events[-1] == b"data: [DONE]"
    assert fake.stats()["models"] == ["p-upstream"]  # the model was renamed upstream


async def test_keepalives_while_the_first_token_is_awaited(one_upstream) -> None:
    fake, gateway = one_upstream
    # The upstream answers only once the client has had three keepalives (without them it would
    # wait until the gateway's first-byte timeout, and the stream would hold no data).
    body = chat_body(stream=True, fake={"chunks": 2, "stall_gate": "keepalives-seen"})
    num_keepalives = 0

    def answer_after_three_keepalives(event: bytes) -> None:
        nonlocal num_keepalives
        if event == b": keepalive":
            num_keepalives += 1
            if num_keepalives == 3:
                fake.release("keepalives-seen")

    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=body) as response:
        events = await read_events(response, answer_after_three_keepalives)
    first_data = next((i for i, e in enumerate(events) if e.startswith(b"data: {")), len(events))
    assert first_data >= 3 and all(e == b": keepalive" for e in events[:first_data])
    assert events[-1] == b"data: [DONE]" and b": keepalive" not in events[first_data:]


async def test_non_streaming_relay_and_request_ids(one_upstream) -> None:
    fake, gateway = one_upstream
    async with aiohttp.ClientSession() as client:
        async with client.post(gateway.url + CHAT, json=chat_body()) as response:
            generated = response.headers["x-request-id"]
        async with client.post(gateway.url + CHAT, json=chat_body(extra_field={"kept": True}),
                               headers={"x-request-id": "req-123"}) as response:
            assert response.status == 200
            assert response.headers["x-request-id"] == "req-123"
            payload = await response.json()
    assert generated and generated != "req-123"
    assert payload["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    stats = fake.stats()
    assert stats["models"] == ["p-upstream", "p-upstream"]  # renamed to the provider's upstream model
    assert stats["request_ids"] == [generated, "req-123"]   # the request id travels upstream
    assert stats["last_body"]["extra_field"] == {"kept": True}  # unknown fields pass through


async def test_mid_stream_reset_ends_with_error_event_when_failover_is_off(start_fakes, start_gateway) -> None:
    a, b = start_fakes("a", "b")
    config = gateway_config({"p": [a.url, b.url]})
    config["models"]["m"]["mid_stream_failover"] = False
    gateway = start_gateway(config)
    body = chat_body(stream=True, fake={"chunks": 5, "chunk_delay_s": 0.05, "reset_after": 2})
    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=body) as response:
        assert response.status == 200
        events = await read_events(response)
    contents = [e for e in events if e.startswith(b"data: {\"id\"")]
    assert len(contents) == 2
    error = orjson.loads(events[-2][6:])
    assert error["error"]["type"] == "upstream_error" and "mid-stream" in error["error"]["message"]
    assert events[-1] == b"data: [DONE]"
    assert a.stats()["num_requests"] + b.stats()["num_requests"] == 1  # the upstream was hit once


def _read_slowly(base_url: str, body: dict[str, Any]) -> bytes:
    """POST over a socket with a 4 KiB receive buffer, read 2 KiB at a time with a pause between reads; the
    response's body, de-chunked."""
    host, port = base_url.removeprefix("http://").split(":")
    raw = orjson.dumps(body)
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n").encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect((host, int(port)))
        sock.sendall(head + raw)
        reply = b""
        while chunk := sock.recv(2048):
            reply += chunk
            time.sleep(0.0005)    # slower than the gateway writes: its buffer for this client fills
    response_head, _, chunked = reply.partition(b"\r\n\r\n")
    assert response_head.startswith(b"HTTP/1.1 200") and b"chunked" in response_head.lower(), response_head
    data, at = b"", 0
    while (size := int(chunked[at:chunked.index(b"\r\n", at)], 16)) > 0:
        start = chunked.index(b"\r\n", at) + 2
        data += chunked[start:start + size]
        at = start + size + 2
    return data


async def test_a_slow_reader_gets_a_long_stream_whole(one_upstream) -> None:
    """40,000 events (about 6.6 MB, more than a socket's send buffer grows to on Linux, 4 MiB) to a client that
    reads slowly through a small socket buffer: the relay fills the client's buffer, waits for it to drain and
    goes on. Every event arrives once, in order, then [DONE]."""
    _, gateway = one_upstream
    data = await asyncio.to_thread(_read_slowly, gateway.url, chat_body(stream=True, fake={"chunks": 40000}))
    events = data.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    contents = [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in events if e.startswith(b"data: {")]
    assert contents == [f"tok{i} " for i in range(40000)]


@pytest.mark.parametrize("lean_http", [True, False], ids=["lean server", "aiohttp server"])
async def test_a_client_that_leaves_while_the_relay_waits_for_it_is_not_the_upstreams_failure(
        start_fakes, start_gateway, lean_http: bool) -> None:
    """The client stops reading a stream longer than the sockets between them hold, then closes. That ends
    the request as the client's leaving, whether the relay was writing or waiting for the client's buffer:
    no failover to the other upstream (it would be a second request), and the lease is released."""
    a, b = start_fakes("a", "b")
    config = gateway_config({"p": [a.url, b.url]})
    config["listen"] = {"lean_http": lean_http}
    gateway = start_gateway(config)
    host, port = gateway.url.removeprefix("http://").split(":")
    raw = orjson.dumps(chat_body(stream=True, fake={"chunks": 40000}))   # 6.6 MB: more than the socket holds
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        # The upstream serving it sends far more than the client reads: the gateway holds the rest (on a
        # machine whose sockets hold 6.6 MB the relay has ended by the close: the assertions hold all the same).
        await await_until(lambda: a.stats()["num_requests"] + b.stats()["num_requests"] == 1, "the upstream request")
    await await_until(lambda: metric(gateway, "switchyard_inflight_requests", endpoint=a.url)
                      + metric(gateway, "switchyard_inflight_requests", endpoint=b.url) == 0,
                      "the lease to be released")
    assert a.stats()["num_requests"] + b.stats()["num_requests"] == 1
    assert gateway.alive
