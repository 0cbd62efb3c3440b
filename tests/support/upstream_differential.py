"""The lean upstream client's response parsing (gateway/upstream/http_client.py and connection.py) beside aiohttp's
llhttp-based response parser, as aiohttp's client runs it (lenient), on the same bytes; and the rule that the two
agree (`assert_agrees`).

The lean side runs as a leg does: `UpstreamClient.post(...)` entered, the body read with `readany`, the exchange
left; its connection gets the bytes read by read, and the transport only records the request written to it.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpResponseParser

from gateway.upstream.connection import UpstreamConnection
from gateway.upstream.deadlines import Deadlines
from gateway.upstream.http_client import UpstreamClient
from tests.support.lean_differential import RecordingTransport

URL = "http://upstream.test:8000/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)
MAX_YIELDS = 1_000     # bounds the wait for the reader to want more bytes (it needs a handful of loop turns)


@dataclass
class Answer:
    """One response as a parser saw it."""

    status: int | None = None                          # None: no head
    headers: tuple[tuple[str, str], ...] = ()          # as sent, in order (values without surrounding whitespace)
    body: bytes = b""                                  # the body bytes decoded (so far)
    complete: bool = False                             # the whole body was read
    error: str | None = None                           # why the parser gave up; None: it did not
    reusable: bool = False                             # the lean client pooled the connection / aiohttp keeps it


def reference(data: bytes, eof: bool) -> Answer:
    """aiohttp's client parser fed one byte at a time (then the end of the connection, when `eof`), informational
    responses skipped as its client does."""
    loop = asyncio.get_running_loop()
    parser = HttpResponseParser(BaseProtocol(loop), loop, 1 << 22, read_until_eof=True, auto_decompress=False)
    messages: list[Any] = []
    out = Answer()
    try:
        for i in range(len(data)):
            messages += parser.feed_data(data[i:i + 1])[0]
        if eof:
            parser.feed_eof()
    except HttpProcessingError as exc:
        out.error = repr(exc)
    final = next(((m, p) for m, p in messages if not 100 <= m.code < 200 or m.code == 101), None)
    if final is None:
        out.error = out.error or "no final response"
        return out
    message, payload = final
    out.status = message.code
    out.headers = tuple((n.decode("latin-1"), v.decode("latin-1")) for n, v in message.raw_headers)
    out.body = b"".join(getattr(payload, "_buffer", ()))
    failed = payload.exception() if hasattr(payload, "exception") else None
    out.complete = payload.is_eof() and failed is None
    out.error = out.error or (repr(failed) if failed is not None else None)
    out.reusable = out.complete and not message.should_close
    return out


async def lean(chunks: Sequence[bytes], eof: bool) -> Answer:
    """One leg through the lean client, its connection given `chunks` read by read as the reader waits for them,
    then closed (when `eof`)."""
    conn = UpstreamConnection(Deadlines())
    conn.connection_made(RecordingTransport())   # type: ignore[arg-type]
    client = UpstreamClient(cast(aiohttp.ClientSession, None))   # its https fallback: not used for http://

    async def acquire(key: tuple[str, int], connect_timeout_s: float | None) -> UpstreamConnection:
        return conn

    client.acquire = acquire   # type: ignore[method-assign]
    out = Answer()
    reader = asyncio.create_task(_read(client, out))
    try:
        for chunk in chunks:
            await _until_waiting(conn, reader)
            conn.data_received(chunk)
        await _until_waiting(conn, reader)
        if eof:
            conn.eof_received()
            conn.connection_lost(None)
        await _until_waiting(conn, reader)
        if not reader.done():
            reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        out.reusable = any(conn in idle for idle in client._idle.values())
    finally:
        client.close()
    return out


async def _read(client: UpstreamClient, out: Answer) -> None:
    try:
        async with client.post(URL, data=b"{}", headers={}, timeout=TIMEOUT) as response:
            out.status = response.status
            out.headers = tuple(response.headers.items())
            while data := await response.content.readany():
                out.body += data
            out.complete = True
    except aiohttp.ClientError as exc:    # what a leg fails over on or reports
        out.error = repr(exc)


async def _until_waiting(conn: UpstreamConnection, reader: asyncio.Task[None]) -> None:
    """Let the reader run until it waits for more bytes or is done."""
    for _ in range(MAX_YIELDS):
        if reader.done() or conn._waiter is not None:
            return
        await asyncio.sleep(0)
    raise AssertionError("the lean client neither read on nor waited for bytes")


def assert_agrees(data: bytes, eof: bool, got: Answer) -> None:
    """Whatever the lean client passed on (a head with body bytes, or a whole response) is what aiohttp's client
    reads there; it may give up where aiohttp would not (the leg then fails over), never the other way round on a
    whole body, and it pools a connection only where aiohttp would keep it too."""
    expected = reference(data, eof)
    if got.body or got.complete:
        assert (got.status, got.headers) == (expected.status, expected.headers), (got, expected)
        assert expected.body.startswith(got.body), (got, expected)
    if got.complete:
        assert expected.complete and got.body == expected.body, (got, expected)
    if got.reusable:
        assert expected.reusable, (got, expected)
