"""The upstream HTTP/1.1 client of the hot path: one POST per leg over pooled keep-alive connections, the
response read as it arrives. It does only what a leg needs (Content-Length, chunked or read-to-close bodies,
no redirects, no cookies, no decompression), which costs a fraction of aiohttp's general client per request
(docs/gateway_performance.md). `https://` endpoints go through aiohttp's client (the `fallback` session).

The response offers the part of `aiohttp.ClientResponse` the legs use: `status`, `headers`, `content_type`,
`content.readany()`, `content.read(n)` and `read()`. A connection goes back to the pool only when its
response was read to the end; anything else (an error, a cancellation, a body left unread) closes it. The
connection and the body decoding live in gateway/upstream/connection.py; this module is the pool and the exchange.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from gateway.upstream.connection import UpstreamBody, UpstreamConnection, UpstreamProtocolError
from gateway.upstream.deadlines import Deadlines

# A response head this client reads: the status line, then fields whose names are tokens (RFC 9110 §5.6.2) and
# whose values hold no CR, LF or NUL. Linear whatever the bytes: a value cannot match a line's end.
_HEAD = re.compile(r"HTTP/1\.[01] [0-9]{3}(?: [^\r\n\x00]*)?(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n\x00]*)*")
MAX_HEADER_BYTES = 64 * 1024     # a response head larger than this is a protocol error
MAX_IDLE_S = 10.0                # an idle pooled connection older than this is closed, not reused
MAX_IDLE_PER_HOST = 256          # idle connections kept per host:port


class UpstreamResponse:
    """One leg's response: the status and headers, and the body as it arrives (`content`)."""

    __slots__ = ("_keep_alive", "content", "content_type", "headers", "status")

    def __init__(self, status: int, headers: CIMultiDict[str], content: UpstreamBody, keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.content = content
        self._keep_alive = keep_alive
        raw_type = headers.get("Content-Type")
        self.content_type = raw_type.split(";", 1)[0].strip().lower() if raw_type else "application/octet-stream"

    async def read(self) -> bytes:
        return await self.content.read()


def _parse_head(head: bytes) -> tuple[int, CIMultiDict[str], bool]:
    """(status, headers, HTTP/1.1 keep-alive) from the bytes before the blank line. A head aiohttp's parser might
    read otherwise (a bare CR or LF, a NUL, a folded line, a name not a token, a status not of three digits) is
    an error."""
    text = head.decode("latin-1")
    if _HEAD.fullmatch(text) is None:
        raise UpstreamProtocolError(f"bad response head {text[:60]!r}")
    fields = []
    for line in text.split("\r\n")[1:]:   # name:value, as `_HEAD` matched them
        name, _, value = line.partition(":")
        fields.append((name, value.strip(" \t")))
    headers = CIMultiDict(fields)   # built whole: cheaper than adding the fields one by one
    connection = ",".join(headers.getall("Connection", ())).lower()   # llhttp reads every Connection field
    keep_alive = "close" not in connection if text.startswith("HTTP/1.1") else "keep-alive" in connection
    return int(text[9:12]), headers, keep_alive


def _framing(headers: CIMultiDict[str]) -> tuple[str, int]:
    """The body's framing ("chunked", "length" or "close") and its Content-Length; a UpstreamProtocolError where
    aiohttp's parser would refuse it or read it otherwise."""
    encodings, lengths = headers.getall("Transfer-Encoding", ()), headers.getall("Content-Length", ())
    if encodings:
        if len(encodings) != 1 or encodings[0].lower() != "chunked" or lengths:
            raise UpstreamProtocolError(f"unsupported framing {encodings} {lengths}")
        return "chunked", 0
    if not lengths:
        return "close", 0
    # int() would take "-1", "+3" and "1_0", and raise a ValueError past 4,300 digits
    if len(lengths) != 1 or not (lengths[0].isascii() and lengths[0].isdigit() and len(lengths[0]) <= 18):
        raise UpstreamProtocolError(f"bad Content-Length {lengths}")
    return "length", int(lengths[0])


class _Exchange:
    """`async with client.post(...) as response`: sends the request, reads the head, and on exit pools or
    closes the connection."""

    __slots__ = ("_body", "_client", "_conn", "_deadline", "_headers", "_key", "_response", "_target", "_timeout")

    def __init__(self, client: UpstreamClient, key: tuple[str, int], target: bytes, body: bytes,
                 headers: Mapping[str, str], timeout: aiohttp.ClientTimeout) -> None:
        self._client = client
        self._key = key
        self._target = target
        self._body = body
        self._headers = headers
        self._timeout = timeout
        self._conn: UpstreamConnection | None = None
        self._deadline: int | None = None   # the whole leg's, in the client's deadlines
        self._response: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        conn = self._conn = await self._client.acquire(self._key, self._timeout.sock_connect or self._timeout.connect)
        if self._timeout.total:
            self._deadline = self._client.deadlines.add(time.monotonic() + self._timeout.total, self._over_total)
        head = [b"POST ", self._target, b" HTTP/1.1\r\nHost: ", self._client.host_header(self._key),
                b"\r\nContent-Length: ", str(len(self._body)).encode(), b"\r\n"]
        for name, value in self._headers.items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        head.append(self._body)
        assert conn.transport is not None
        conn.transport.write(b"".join(head))
        while (end := conn.buffer.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES + 4)) < 0:
            if len(conn.buffer) > MAX_HEADER_BYTES:   # however the bytes were split into reads
                raise UpstreamProtocolError("response head too large")
            await conn.more()
        status, headers, keep_alive = _parse_head(conn.take(end + 4)[:-4])
        if 100 <= status < 200:
            raise UpstreamProtocolError(f"unexpected informational status {status}")
        quiet_s = self._timeout.sock_read
        framing, length = _framing(headers)
        if status in (204, 304):
            body = UpstreamBody(conn, "length", 0)
        elif framing == "close":
            body, keep_alive = UpstreamBody(conn, "close", 0, quiet_s), False
        else:
            body = UpstreamBody(conn, framing, length, quiet_s)
        self._response = UpstreamResponse(status, headers, body, keep_alive)
        return self._response

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._deadline is not None:
            self._client.deadlines.discard(self._deadline)
        conn, response = self._conn, self._response
        if conn is None:
            return
        conn.stop_watch()
        if exc is None and response is not None and response._keep_alive and response.content.done \
                and conn.reusable:
            self._client.release(self._key, conn)
        elif conn.transport is not None:
            conn.transport.abort()

    def _over_total(self) -> None:
        if self._conn is not None:
            self._conn.fail(TimeoutError(f"upstream leg over {self._timeout.total}s"))


class UpstreamClient:
    """Pooled keep-alive connections per host:port; `post` is a drop-in for the legs' `session.post`."""

    def __init__(self, fallback: aiohttp.ClientSession, max_idle_s: float = MAX_IDLE_S) -> None:
        self._fallback = fallback
        self._max_idle_s = max_idle_s
        self._idle: dict[tuple[str, int], list[UpstreamConnection]] = {}    # oldest first; reused from the end
        self._sweep: asyncio.TimerHandle | None = None   # closes connections idle past max_idle_s
        self._targets: dict[str, tuple[tuple[str, int], bytes] | None] = {}  # url -> (host:port, target)
        self._host_headers: dict[tuple[str, int], bytes] = {}
        self.deadlines = Deadlines()   # the legs' timeouts: first byte, whole leg, quiet gaps

    def post(self, url: str, *, data: bytes, headers: Mapping[str, str], timeout: aiohttp.ClientTimeout) -> Any:
        target = self._targets.get(url)
        if target is None and url not in self._targets:
            target = self._targets[url] = _split(url)
        if target is None:  # https or anything unusual: aiohttp's client (its sock_read counts before the first
            # body byte too, where first_byte_s governs: not passed)
            timeout = aiohttp.ClientTimeout(total=timeout.total, connect=timeout.connect,
                                            sock_connect=timeout.sock_connect)
            return self._fallback.post(url, data=data, headers=headers, timeout=timeout)
        key, path = target
        return _Exchange(self, key, path, data, headers, timeout)

    def host_header(self, key: tuple[str, int]) -> bytes:
        header = self._host_headers.get(key)
        if header is None:
            host, port = key
            header = self._host_headers[key] = f"{host}:{port}".encode("idna")
        return header

    async def acquire(self, key: tuple[str, int], connect_timeout_s: float | None) -> UpstreamConnection:
        idle = self._idle.get(key)
        now_s = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable and now_s - conn.idle_since_s < self._max_idle_s:
                return conn
            if conn.transport is not None:
                conn.transport.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(connect_timeout_s):
            _, conn = await loop.create_connection(lambda: UpstreamConnection(self.deadlines), key[0], key[1])
        return conn

    def release(self, key: tuple[str, int], conn: UpstreamConnection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= MAX_IDLE_PER_HOST:
            assert conn.transport is not None
            conn.transport.close()
            return
        conn.idle_since_s = time.monotonic()
        idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._max_idle_s, self._close_stale)

    def _close_stale(self) -> None:
        """Close the connections idle for `max_idle_s` (reuse takes the newest, so after a burst the oldest
        would otherwise stay open until the upstream closes them); again while any stay idle."""
        self._sweep = None
        now_s = time.monotonic()
        oldest_s = now_s
        for idle in self._idle.values():
            num_stale = next((i for i, conn in enumerate(idle) if now_s - conn.idle_since_s < self._max_idle_s),
                             len(idle))
            for conn in idle[:num_stale]:
                if conn.transport is not None:
                    conn.transport.close()
            del idle[:num_stale]
            if idle:
                oldest_s = min(oldest_s, idle[0].idle_since_s)
        if any(self._idle.values()):
            self._sweep = asyncio.get_running_loop().call_later(
                max(0.0, oldest_s + self._max_idle_s - now_s), self._close_stale)

    def close(self) -> None:
        self.deadlines.close()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()


def _split(url: str) -> tuple[tuple[str, int], bytes] | None:
    """((host, port), request target) of a plain http:// URL; None for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
        return None
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, parts.port or 80), target.encode("ascii")
