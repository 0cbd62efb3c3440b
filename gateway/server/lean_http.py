"""A lean HTTP/1.1 server for the generation routes, in front of aiohttp's for everything else.

aiohttp's server costs about a quarter of the gateway's CPU per request (its protocol, request and
response objects, router and middleware plumbing). This one serves only what a generation request
usually is: `POST /v1/chat/completions`, `/v1/completions` or `/v1/messages`, HTTP/1.1, a Content-Length
body, plain ASCII headers. It runs the app's own middlewares and handlers (`LeanRequest` has what they read), and
writes their `web.Response`, or a stream through `LeanSse` (gateway/server/lean_stream.py), straight to the transport.

Anything else on a connection (another route or method, a chunked body, `Expect`, `Upgrade`, HTTP/1.0, no Host,
a field aiohttp takes once given twice, a head too long or not plainly formed) hands the connection, with the bytes
not yet served, to aiohttp's own protocol for the rest of its life: aiohttp then parses, answers or rejects it as it
always did. So this parser only has to recognise its subset exactly; it never has to reject anything
(tests/gateway/test_lean_http_differential.py holds it to aiohttp's parser).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from email.utils import formatdate
from typing import Any, Protocol, cast

from aiohttp import web
from aiohttp.http_parser import SINGLETON_HEADERS
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import GatewayError, error_response

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[web.StreamResponse]]

# The request line and headers this server takes (anything else goes to aiohttp): one of `paths`,
# header names that are tokens, values of printable ASCII and tabs, CRLF line ends, no folding. No two
# parts of a line can match the same bytes (a value starts with a visible character), so matching takes
# linear time whatever the bytes: no input can make the regex engine backtrack quadratically.
_HEADER = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[ \t]*(?:[\x21-\x7e][\x20-\x7e\t]*)?\r\n"
LINGER_S = 10.0            # the longest a connection answered before its body reads the rest (aiohttp's too)


class LeanRequest(dict[Any, Any]):
    """What the middlewares and generation handlers read of a request (the dict is aiohttp's
    per-request storage, e.g. the caller's key)."""

    __slots__ = ("_body", "_body_arrived", "app", "headers", "path", "protocol")
    method = "POST"

    def __init__(self, app: web.Application, path: str, headers: CIMultiDictProxy[str],
                 protocol: LeanProtocol, body: bytes | None) -> None:
        super().__init__()
        self.app = app
        self.path = path
        self.headers = headers
        self.protocol = protocol
        self._body = body
        self._body_arrived: asyncio.Future[None] | None = None

    @property
    def body_complete(self) -> bool:
        return self._body is not None

    async def read(self) -> bytes:
        """The whole body (it may still be arriving: the handler bounds the wait)."""
        if self._body is None:
            if self._body_arrived is None:
                self._body_arrived = asyncio.get_running_loop().create_future()
            await self._body_arrived
        assert self._body is not None
        return self._body

    def set_body(self, body: bytes) -> None:
        self._body = body
        if self._body_arrived is not None and not self._body_arrived.done():
            self._body_arrived.set_result(None)


class LeanServer:
    """One per site: the app, its middlewares wrapped around the lean routes, and aiohttp's protocol
    factory for the connections this server hands over."""

    def __init__(self, app: web.Application, routes: Mapping[str, Handler], aiohttp_protocol: Callable[[], Any], *,
                 max_head_bytes: int, max_headers: int, max_body_bytes: int, idle_timeout_s: float) -> None:
        self.app = app
        self.handlers = {path: _with_middlewares(handler, app.middlewares) for path, handler in routes.items()}
        # The request line and headers in one match: `paths` only, at most `max_headers` fields.
        paths = b"|".join(re.escape(p.encode()) for p in routes)
        self.head_re = re.compile(rb"POST (%b) HTTP/1\.1\r\n((?:%b){0,%d})\r\n" % (paths, _HEADER, max_headers))
        self.aiohttp_protocol = aiohttp_protocol
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[LeanProtocol] = set()
        self._sweep: asyncio.TimerHandle | None = None

    def __call__(self) -> LeanProtocol:
        if self._sweep is None and self.idle_timeout_s > 0:
            self._schedule_sweep()
        return LeanProtocol(self)

    def _schedule_sweep(self) -> None:
        self._sweep = asyncio.get_running_loop().call_later(self.idle_timeout_s / 4, self._close_idle)

    def _close_idle(self) -> None:
        """Close the connections idle (no whole request head) for `idle_timeout_s`, give or take a quarter:
        one timer for them all, where one per request would cost every request a timer to arm and cancel."""
        cutoff = asyncio.get_running_loop().time() - self.idle_timeout_s
        for connection in [c for c in self.connections if c.idle_since is not None and c.idle_since <= cutoff]:
            connection.close()
        self._schedule_sweep()

    def close_connections(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        for connection in list(self.connections):
            connection.close()


class SentStream(Protocol):
    """What the connection reads of a streamed answer (gateway/server/lean_stream.py's LeanSse), which
    imports this module."""

    ended: bool   # its body's last chunk was written


class LeanProtocol(asyncio.Protocol):
    """One client connection while it is lean: requests one at a time (pipelined ones wait in the buffer)."""

    def __init__(self, server: LeanServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buffer: bytes | bytearray = b""       # received, not yet served (a bytearray once it grows)
        self._scanned = 0                          # how far the buffer holds no whole head
        self._request: LeanRequest | None = None   # the request being served
        self.stream: SentStream | None = None      # its streamed answer (lean_stream.LeanSse), once one started
        self._body_length = 0                      # its Content-Length, while its body is still arriving
        self._task: asyncio.Task[None] | None = None
        self.idle_since: float | None = None       # loop time since which no request head is whole (None: one is)
        self._writable: asyncio.Future[None] | None = None   # set while the transport is paused for writing
        self._reading_paused = False
        self._discard_left: int | None = None      # lingering: body bytes still to drop before closing
        self.keep_alive = True

    # --- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # uvloop's are not asyncio.Transport subclasses
        self._server.connections.add(self)
        self.idle_since = self._loop.time()

    def data_received(self, data: bytes) -> None:
        if self._discard_left is not None:   # lingering: the rest of a body that was answered early
            self._discard_left -= len(data)
            if self._discard_left <= 0:
                self.close()
            return
        if not self._buffer:
            self._buffer = data                   # the usual case: a whole request in one read, no copy
        else:   # appended in place: a body or head in many reads costs no quadratic copying
            if isinstance(self._buffer, bytes):
                self._buffer = bytearray(self._buffer)
            self._buffer += data
        request = self._request
        if request is None:
            self._next()
        elif not request.body_complete and len(self._buffer) >= self._body_length:
            body, self._buffer = bytes(self._buffer[:self._body_length]), self._buffer[self._body_length:]
            request.set_body(body)
        elif len(self._buffer) > self._server.max_body_bytes + self._server.max_head_bytes and self.transport:
            self.transport.pause_reading()    # a client racing ahead of its answers: it waits for them
            self._reading_paused = True

    def eof_received(self) -> None:
        return None    # the transport closes; a request in flight is cancelled (as aiohttp does)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self.transport = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the client closed its connection"))

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed its connection")
        if self._writable is not None:
            await self._writable

    # --- requests ------------------------------------------------------------------------------------

    def _next(self) -> None:
        """Start the request at the buffer's front once its head is whole; or hand the connection over."""
        buffer, server = self._buffer, self._server
        head_end = buffer.find(b"\r\n\r\n", self._scanned)
        if head_end < 0:
            if len(buffer) > server.max_head_bytes or buffer.find(b"\n\n", self._scanned) >= 0 \
                    or (buffer and buffer[:1] != b"P"):
                self._hand_over()
                return
            self._scanned = max(0, len(buffer) - 3)   # a head's end may straddle the next read
            return
        self._scanned = 0
        match = server.head_re.match(buffer, 0, head_end + 4) if head_end < server.max_head_bytes else None
        if match is None or match.end() != head_end + 4:
            self._hand_over()
            return
        framing = _framing(match.group(2), server.max_body_bytes)
        if framing is None:
            self._hand_over()
            return
        headers, length, self.keep_alive = framing
        self.idle_since = None
        start = head_end + 4
        complete = len(buffer) - start >= length
        body = bytes(buffer[start:start + length]) if complete else None
        self._buffer = buffer[start + length:] if complete else buffer[start:]
        self._body_length = length
        path = match.group(1).decode()
        self._request = request = LeanRequest(server.app, path, headers, self, body)
        self._task = self._loop.create_task(self._serve(request, server.handlers[path]))

    async def _serve(self, request: LeanRequest, handler: Handler) -> None:
        try:
            response = await handler(request)
        except (ConnectionResetError, asyncio.CancelledError):
            self.close()
            return
        except Exception:
            log.exception("unhandled error on POST %s", request.path)
            response = error_response(GatewayError("internal gateway error", code="internal_error"))
        if not request.body_complete:
            self.keep_alive = False     # an answer before the body (an error): the connection ends after it
        stream, self.stream = self.stream, None
        # A stream sent itself; one cut short, or any response after a stream started, cannot go on framed.
        sent = response is stream and stream.ended if stream is not None else self._write_response(response)
        if not sent:
            self.close()
            return
        self._request = self._task = None
        if not request.body_complete:
            self._linger()
            return
        if not self.keep_alive:
            self.close()
            return
        self.idle_since = self._loop.time()
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._buffer:
            self._next()

    def _linger(self) -> None:
        """Read and drop the rest of the body, then close (RFC 9112 §9.6): a close with request bytes unread
        resets the connection, and a client still sending would lose the answer. At most `LINGER_S`."""
        self._discard_left = self._body_length - len(self._buffer)
        self._buffer = b""
        if self._discard_left <= 0:
            self.close()
            return
        self._loop.call_later(LINGER_S, self.close)

    def _write_response(self, response: web.StreamResponse) -> bool:
        """Send a whole response; False when it cannot be sent (the connection then closes)."""
        body = response.body if isinstance(response, web.Response) else response
        if not isinstance(body, (bytes, bytearray, type(None))) or response.prepared or response.chunked:
            log.error("the lean server cannot send %r", response)    # a handler's bug: nothing sends one
            return False
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        body = bytes(body or b"")
        if response.headers.get("Connection", "").lower() == "close":
            self.keep_alive = False
        transport.write(encode_head(response.status, response.reason, response.headers.items(), len(body),
                                    self.keep_alive) + body)
        return True

    def _hand_over(self) -> None:
        """From here on aiohttp's protocol serves this connection, starting with the bytes not yet served."""
        transport, buffer = self.transport, self._buffer
        self._server.connections.discard(self)
        self.transport, self._buffer = None, b""
        if transport is None or transport.is_closing():
            return
        protocol = self._server.aiohttp_protocol()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if buffer:
            protocol.data_received(bytes(buffer))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _framing(lines: bytes, max_body_bytes: int) -> tuple[CIMultiDictProxy[str], int, bool] | None:
    """(headers, Content-Length, keep-alive) of header lines `_HEADER` matched; None where aiohttp's parser may
    read them otherwise or reject them: no one Content-Length of at most `max_body_bytes`, no Host, a field aiohttp
    takes once given twice (Host, Content-Type...), Transfer-Encoding, Expect or an upgrade. The connection goes
    on unless any Connection field lists `close` (llhttp reads them all, not the first)."""
    fields = []
    for line in lines.decode("ascii").split("\r\n")[:-1]:   # name:value
        name, _, value = line.partition(":")
        fields.append((name, value.strip(" \t")))
    singletons = [lowered for name, _ in fields if (lowered := name.lower()) in SINGLETON_HEADERS]
    if "host" not in singletons or len(set(singletons)) != len(singletons):
        return None
    headers = CIMultiDictProxy(CIMultiDict(fields))
    length = headers.get("Content-Length", "")
    connection = ",".join(headers.getall("Connection", ())).lower()
    if not length.isdigit() or len(length) > 18 or int(length) > max_body_bytes \
            or "Transfer-Encoding" in headers or "Expect" in headers or "Upgrade" in headers \
            or "upgrade" in connection:
        return None
    return headers, int(length), "close" not in connection


def _with_middlewares(handler: Handler, middlewares: Iterable[Any]) -> Handler:
    """The handler as aiohttp's app calls it: inside the app's middlewares, the first one outermost."""
    for middleware in reversed(tuple(middlewares)):
        handler = functools.partial(middleware, handler=handler)
    return handler


class LeanSite(web.BaseSite):
    """A TCP site whose connections start lean (`LeanServer`) and go to aiohttp's protocol when they need it."""

    __slots__ = ("_host", "_lean", "_port", "_reuse_port")

    def __init__(self, runner: web.AppRunner, routes: Mapping[str, Handler], host: str, port: int, *,
                 max_head_bytes: int, max_headers: int, max_body_bytes: int, idle_timeout_s: float,
                 ssl_context: Any = None, backlog: int = 128, reuse_port: bool | None = None) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        assert runner.server is not None
        self._host, self._port, self._reuse_port = host, port, reuse_port
        self._lean = LeanServer(runner.app, routes, runner.server, max_head_bytes=max_head_bytes,
                                max_headers=max_headers, max_body_bytes=max_body_bytes, idle_timeout_s=idle_timeout_s)

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._lean, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=True, reuse_port=self._reuse_port)

    async def stop(self) -> None:
        await super().stop()
        self._lean.close_connections()


def encode_head(status: int, reason: str, headers: Iterable[tuple[str, str]], content_length: int | None = None,
                keep_alive: bool = True) -> bytes:
    """The status line and headers; the framing headers are this function's own (`content_length`, or the
    caller's Transfer-Encoding when it is None) and Connection says only `close`, when not `keep_alive`."""
    lines = [f"HTTP/1.1 {status} {reason}\r\n"]
    framing = _FRAMING if content_length is not None else _FRAMING[:2]
    for name, value in headers:
        if name.lower() in framing:
            continue
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"a line break in the response header {name!r}")
        lines.append(f"{name}: {value}\r\n")
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append(_date_and_server())
    return "".join(lines).encode("latin-1")


_FRAMING = ("content-length", "connection", "transfer-encoding")


@functools.lru_cache(maxsize=2)
def _date_header(second: int) -> str:
    return f"Date: {formatdate(second, usegmt=True)}\r\nServer: switchyard\r\n\r\n"


def _date_and_server() -> str:
    return _date_header(int(time.time()))
