"""A streamed answer on the lean HTTP/1.1 server's connection (gateway/server/lean_http.py), written chunked
straight to the transport (`LeanSse`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from gateway.server.lean_http import LeanProtocol, encode_head

HIGH_WATER = 64 * 1024     # unsent bytes above which a relay waits for the client (aiohttp's limit too)


class LeanSse(web.StreamResponse):
    """A streamed response on a lean connection, chunked. Like aiohttp's SSE response in client_stream.py it
    holds the head back until the first body bytes, so both leave in one write. It is a StreamResponse
    for its status and headers only: it writes to the transport itself."""

    def __init__(self, protocol: LeanProtocol, *, status: int, headers: Mapping[str, str]) -> None:
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
