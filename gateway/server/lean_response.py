"""The lean HTTP/1.1 server's responses (gateway/server/lean_http.py): the head of a whole answer (`encode_head`),
and a streamed one written chunked straight to the transport (`LeanSse`).
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from email.utils import formatdate
from typing import Any, Protocol

from aiohttp import web

HIGH_WATER = 64 * 1024     # unsent bytes above which a relay waits for the client (aiohttp's limit too)


class LeanConnection(Protocol):
    """What a streamed answer needs of its lean connection (lean_http.LeanProtocol), so that this module
    does not import the server that imports it."""

    transport: asyncio.Transport | None
    stream: LeanSse | None       # set when the stream starts: the connection routes write pauses to it
    keep_alive: bool

    async def drain(self) -> None: ...


class LeanSse(web.StreamResponse):
    """A streamed response on a lean connection, chunked. Like aiohttp's SSE response in client_stream.py it
    holds the head back until the first body bytes, so both leave in one write. It is a StreamResponse
    for its status and headers only: it writes to the transport itself."""

    def __init__(self, protocol: LeanConnection, *, status: int, headers: Mapping[str, str]) -> None:
        super().__init__(status=status, headers=headers)
        self._protocol = protocol
        self._lean_prepared = False
        self._head: bytes | None = None     # not yet sent
        self.ended = False

    @property
    def prepared(self) -> bool:
        return self._lean_prepared

    async def prepare(self, request: Any) -> None:
        self.headers["Transfer-Encoding"] = "chunked"
        self._protocol.stream = self
        self._head = encode_head(self.status, self.reason, self.headers.items(), keep_alive=self._protocol.keep_alive)
        self._lean_prepared = True

    def fast_writer(self) -> Callable[[bytes], bool]:
        """A synchronous chunk write (see `ClientStream.fast_writer`): True when the client's buffer is full."""
        return self._write

    def _write(self, data: bytes) -> bool:
        transport = self._protocol.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        if self.ended:
            raise RuntimeError("a write after the response's end")   # as aiohttp's write after write_eof
        if not data:
            return False     # an empty chunk would end the chunked body
        chunk = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head is not None:
            chunk, self._head = self._head + chunk, None
        transport.write(chunk)
        return transport.get_write_buffer_size() > HIGH_WATER

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if data and self._write(bytes(data)):
            await self.drain()

    async def drain(self) -> None:
        await self._protocol.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.ended:
            return
        transport = self._protocol.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        # The last data, if any, and the chunked body's end in one write.
        last = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        transport.write((self._head or b"") + last + b"0\r\n\r\n")
        self._head = None
        self.ended = True


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
