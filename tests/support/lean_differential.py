"""The lean HTTP/1.1 server's parser (gateway/server/lean_http.py) beside aiohttp's llhttp-based one on the same
bytes: what each sees of a connection's requests, and the rule that the two agree (`assert_agrees`).

The lean side runs at its real entry point, `LeanProtocol.data_received`, read by read, with handlers that record
what they were given; the transport only records what was written and to which protocol the connection went.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser

from gateway.api import lean_routes
from gateway.server.lean_http import LeanProtocol, LeanRequest, LeanServer

LEAN_PATHS = tuple(lean_routes())
MAX_HEAD_BYTES = 400       # small, so that generated heads cross it (the gateway's is 8190; the corpus tries that too)
MAX_HEADERS = 8            # likewise (the gateway's: 100)
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_head_bytes: int = MAX_HEAD_BYTES   # the lean head's, and aiohttp's max_line_size and max_field_size
    max_headers: int = MAX_HEADERS         # both parsers' field count


@dataclass
class Seen:
    """One request as a parser saw it."""

    method: str
    path: str
    version: tuple[int, int]
    headers: tuple[tuple[str, str], ...]    # as sent, in order (values without surrounding whitespace)
    keep_alive: bool                        # the connection goes on after this request's answer
    body: bytes | None = None               # None: not all of it arrived


@dataclass
class Reference:
    """What aiohttp's parser makes of a connection's bytes: requests until the bytes end or it rejects them."""

    requests: list[Seen] = field(default_factory=list)
    error: str | None = None     # why it rejected the bytes after `requests`; None: it did not


def reference(data: bytes, limits: Limits) -> Reference:
    """aiohttp's parser (the C one when built) fed one byte at a time: a request completed in the same read as an
    error is otherwise lost with that read, and llhttp's streaming must not depend on the reads anyway."""
    loop = asyncio.get_running_loop()
    parser = HttpRequestParser(BaseProtocol(loop), loop, 1 << 22, max_line_size=limits.max_head_bytes,
                               max_field_size=limits.max_head_bytes, max_headers=limits.max_headers)
    out, payloads = Reference(), []
    for i in range(len(data)):
        try:
            messages, upgraded, _ = parser.feed_data(data[i:i + 1])
        except HttpProcessingError as exc:
            out.error = repr(exc)
            break
        for message, payload in messages:
            out.requests.append(Seen(message.method, message.path, tuple(message.version),
                                     tuple((n.decode("latin-1"), v.decode("latin-1")) for n, v in message.raw_headers),
                                     not message.should_close))
            payloads.append(payload)
        if upgraded:
            out.error = "upgraded"     # whatever follows is another protocol's
            break
    for seen, payload in zip(out.requests, payloads, strict=True):
        body = b"".join(getattr(payload, "_buffer", ()))    # EMPTY_PAYLOAD: no body
        seen.body = body if payload.is_eof() and payload.exception() is None else None
    return out


class RecordingTransport:
    """The part of an asyncio transport that the lean protocol uses; records instead of sending."""

    def __init__(self) -> None:
        self.protocol: Any = None
        self.written = bytearray()
        self.closed = False

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0


class HandedOver(asyncio.Protocol):
    """Stands where aiohttp's protocol takes a handed-over connection: what it would be given."""

    def __init__(self) -> None:
        self.data = bytearray()

    def data_received(self, data: bytes) -> None:
        self.data += data


@dataclass
class Lean:
    """What the lean server did with a connection's bytes."""

    requests: list[Seen] = field(default_factory=list)
    handed_over: bytes | None = None     # the bytes aiohttp's protocol was given; None: no hand-over
    closed: bool = False


async def lean(chunks: Sequence[bytes], limits: Limits) -> Lean:
    """Feed the reads to a lean connection, each once the requests before it are answered as far as they can
    be, and record what the handlers saw."""
    out, handed = Lean(), HandedOver()

    async def handler(request: LeanRequest) -> web.Response:
        seen = Seen(request.method, request.path, (1, 1), tuple(request.headers.items()), request.protocol.keep_alive)
        out.requests.append(seen)
        seen.body = await request.read()
        return web.Response(text="ok")

    server = LeanServer(web.Application(), dict.fromkeys(LEAN_PATHS, handler), lambda: handed,
                        max_head_bytes=limits.max_head_bytes, max_headers=limits.max_headers,
                        max_body_bytes=MAX_BODY_BYTES, idle_timeout_s=0)
    transport = RecordingTransport()
    protocol = server()
    transport.set_protocol(protocol)
    protocol.connection_made(transport)   # type: ignore[arg-type]
    for chunk in chunks:
        if transport.closed:
            break
        transport.protocol.data_received(chunk)
        await _settle(protocol)
    if transport.protocol is handed:
        out.handed_over = bytes(handed.data)
    out.closed = transport.closed
    protocol.connection_lost(None)    # a handler still waiting for its body is cancelled
    return out


async def _settle(protocol: LeanProtocol) -> None:
    """Run the handlers until the one in flight (if any) waits for body bytes not yet read."""
    while (task := protocol._task) is not None and protocol._request is not None and protocol._request.body_complete:
        await task


def assert_agrees(data: bytes, got: Lean, limits: Limits) -> None:
    """The lean server saw each request it served as aiohttp's parser sees it, and handed the connection over
    exactly where aiohttp's next request starts; or it refused more: it stopped (closed, or waits for a head)
    where aiohttp would go on. Never a request aiohttp does not see, nor one seen differently."""
    expected = reference(data, limits)
    assert len(got.requests) <= len(expected.requests), (got, expected)
    for seen, want in zip(got.requests, expected.requests, strict=False):
        assert (seen.method, seen.path, seen.version, seen.headers) == \
            (want.method, want.path, want.version, want.headers), (seen, want)
        assert seen.body == want.body, (seen, want)
        assert want.keep_alive or not seen.keep_alive, (seen, want)   # closing where aiohttp goes on is only stricter
    num_seen = len(got.requests)
    if got.handed_over is not None:
        assert data.endswith(got.handed_over), got
        rest = reference(got.handed_over, limits)
        assert rest.requests == expected.requests[num_seen:], (rest, expected)
        assert (rest.error is None) == (expected.error is None), (rest, expected)
    elif not got.closed:
        # Waiting for the rest of a head (or body): aiohttp must not have a request the lean server has not.
        assert len(expected.requests) == num_seen, (got, expected)
