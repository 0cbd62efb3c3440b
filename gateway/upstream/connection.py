"""One pooled upstream connection of gateway/upstream/http_client.py's client (`UpstreamConnection`: the socket's
bytes buffered, with backpressure, EOF and quiet-gap watching) and the response body read from it
(`UpstreamBody`: Content-Length, chunked or read-to-close, decoded as it arrives).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from gateway.upstream.deadlines import Deadlines

MAX_BUFFER_BYTES = 256 * 1024    # stop reading the socket while this much is unread (backpressure)
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class UpstreamProtocolError(aiohttp.ClientPayloadError):
    """The upstream's bytes are not HTTP/1.1 as expected (a payload error: legs count it as a connection error)."""


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection: bytes arrive into `buffer`; one reader waits for more at a time, or one callback
    (`on_bytes`, set by `UpstreamBody.pump`) runs in the data callback itself."""

    __slots__ = ("_deadlines", "_paused", "_quiet_key", "_quiet_limit_s", "_waiter", "buffer", "closed_exc", "eof",
                 "idle_since_s", "last_data_s", "on_bytes", "transport")

    def __init__(self, deadlines: Deadlines) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.closed_exc: BaseException | None = None
        self.idle_since_s = 0.0
        self.last_data_s = 0.0             # time.monotonic() of the last bytes received
        self._waiter: asyncio.Future[None] | None = None
        self.on_bytes: Callable[[], None] | None = None   # instead of a waiter: called on bytes, EOF or loss
        self._paused = False
        self._deadlines = deadlines
        self._quiet_key: int | None = None     # the quiet-gap deadline, while watched
        self._quiet_limit_s = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.last_data_s = time.monotonic()
        if len(self.buffer) > MAX_BUFFER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None and self.closed_exc is None:
            self.closed_exc = exc
        self._wake()

    def fail(self, exc: BaseException) -> None:
        """End the connection with `exc` for whoever reads next (the total timeout)."""
        if self.closed_exc is None:
            self.closed_exc = exc
        self.eof = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def watch_quiet(self, limit_s: float) -> None:
        """From now on `limit_s` without a byte fails the connection with TimeoutError. The deadline moves
        on from the last bytes when it comes, so a steady stream costs one per `limit_s`, not one per read."""
        self.last_data_s = time.monotonic()
        self._quiet_limit_s = limit_s
        self._quiet_key = self._deadlines.add(self.last_data_s + limit_s, self._check_quiet)

    def stop_watch(self) -> None:
        if self._quiet_key is not None:
            self._deadlines.discard(self._quiet_key)
            self._quiet_key = None

    def _check_quiet(self) -> None:
        limit_s = self._quiet_limit_s
        if time.monotonic() - self.last_data_s >= limit_s:
            self._quiet_key = None
            self.fail(TimeoutError(f"upstream sent nothing for {limit_s}s mid-body"))
        else:
            self._quiet_key = self._deadlines.add(self.last_data_s + limit_s, self._check_quiet)

    def _wake(self) -> None:
        if self.on_bytes is not None:
            self.on_bytes()
            return
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self, num_bytes: int, keep: bool = True) -> bytes:
        """Remove the first `num_bytes` from the buffer; returned unless `keep` is False."""
        data = bytes(self.buffer[:num_bytes]) if keep else b""
        del self.buffer[:num_bytes]
        if self._paused and len(self.buffer) <= MAX_BUFFER_BYTES // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def more(self) -> None:
        """Wait for more bytes; raises once the connection ended without them."""
        if self.closed_exc is not None:
            raise self.closed_exc
        if self.eof:
            raise aiohttp.ServerDisconnectedError()
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter
        if self.closed_exc is not None:
            raise self.closed_exc

    @property
    def reusable(self) -> bool:
        return (not self.eof and self.closed_exc is None and not self.buffer and self.transport is not None
                and not self.transport.is_closing())


class UpstreamBody:
    """The response body as `aiohttp.StreamReader`'s `readany`/`read(n)`: decoded bytes as they arrive."""

    __slots__ = ("_chunk_left", "_conn", "_left", "_mode", "_pending", "_quiet_s", "done")

    def __init__(self, conn: UpstreamConnection, mode: str, length: int, quiet_s: float | None = None) -> None:
        self._conn = conn
        self._quiet_s = quiet_s    # after the first body bytes, the longest gap between bytes (None: any)
        self._mode = mode          # "length", "chunked" or "close"
        self._left = length        # "length": body bytes still to come
        self._chunk_left = 0       # "chunked": bytes left of the current chunk (0: a size line is next)
        self._pending = b""        # decoded bytes handed back by read(n)
        self.done = mode == "length" and length == 0

    async def readany(self) -> bytes:
        while (data := self._next_now()) is None:
            if self.done:
                return b""
            await self._conn.more()
        return data

    def pump(self, consume: Callable[[bytes], bool]) -> asyncio.Future[bool]:
        """Hand each decoded chunk to `consume` as its bytes arrive, in the connection's data callback, so no
        task wakes up per chunk, until `consume` returns False or the body ends: the future's result is True
        when `consume` stopped it, False at the body's end. It fails as `readany` would raise (and with
        whatever `consume` raises). Whoever awaits it and is cancelled must `unpump`."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        conn = self._conn

        def on_bytes() -> None:
            try:
                while (data := self._next_now()) is not None:
                    if not consume(data):
                        self._end_pump(future, True)
                        return
                if self.done:
                    self._end_pump(future, False)
            except Exception as exc:  # noqa: BLE001 -- the awaiting task gets it, whatever it is
                conn.on_bytes = None
                if not future.done():
                    future.set_exception(exc)

        conn.on_bytes = on_bytes
        on_bytes()   # what is buffered already
        return future

    def unpump(self) -> None:
        self._conn.on_bytes = None

    def _end_pump(self, future: asyncio.Future[bool], stopped: bool) -> None:
        self._conn.on_bytes = None
        if not future.done():
            future.set_result(stopped)

    def _next_now(self) -> bytes | None:
        """`readany` without waiting: decoded bytes, or None when there are none until more arrive (or at the
        body's end: then `done`). Raises where `readany` raises."""
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        if self.done:
            return None
        data = self._decode()
        if data:
            if self._quiet_s is not None:
                self._conn.watch_quiet(self._quiet_s)
                self._quiet_s = None
            return data
        conn = self._conn
        if self.done:
            return None
        if conn.closed_exc is not None:
            raise conn.closed_exc
        if conn.eof:
            if self._mode != "close":
                raise aiohttp.ClientPayloadError("upstream closed the connection mid-body")
            self.done = True
        return None

    async def read(self, max_bytes: int = -1) -> bytes:
        if max_bytes < 0:
            parts = []
            while chunk := await self.readany():
                parts.append(chunk)
            return b"".join(parts)
        data = await self.readany()
        if len(data) > max_bytes:
            data, self._pending = data[:max_bytes], data[max_bytes:]
        return data

    def _decode(self) -> bytes:
        """Decoded body bytes from what is buffered now (b"" when more must arrive first)."""
        conn = self._conn
        if self._mode == "length":
            take = min(self._left, len(conn.buffer))
            self._left -= take
            self.done = self._left == 0
            return conn.take(take) if take else b""
        if self._mode == "close":
            if conn.buffer:
                return conn.take(len(conn.buffer))
            if conn.eof and conn.closed_exc is None:
                self.done = True
            return b""
        return self._decode_chunked(conn)

    def _decode_chunked(self, conn: UpstreamConnection) -> bytes:
        """Walk the buffered chunks by index and drop what was consumed once. A chunk whose data and CRLF are
        all here (the usual case, many of them when a stream's events arrive in one read) costs one `find`,
        one `int` and one slice."""
        buffer = conn.buffer
        size_left, pos, end_of_data, parts = self._chunk_left, 0, len(buffer), []
        if size_left > 0:   # the rest of a chunk that began in an earlier read
            take = min(size_left, end_of_data)
            parts.append(buffer[:take])
            pos, size_left = take, size_left - take or -1
        while size_left <= 0:
            if size_left == -1:     # the CRLF after a chunk's data is next
                if end_of_data - pos < 2:
                    break
                if buffer[pos:pos + 2] != b"\r\n":
                    raise UpstreamProtocolError("chunked body: no CRLF after a chunk")
                pos, size_left = pos + 2, 0
            line_end = buffer.find(b"\r\n", pos)
            if line_end < 0:
                if end_of_data - pos > 1024:
                    raise UpstreamProtocolError("chunked body: chunk size line too long")
                break
            size_line = buffer[pos:line_end]
            # Hex digits only (int() would also take a sign, spaces, "_" and "0x"); else extensions, or an error.
            size = int(size_line, 16) if 0 < len(size_line) <= 16 and not size_line.translate(None, _HEX_DIGITS) \
                else _chunk_size(size_line)
            if size == 0:  # the last chunk, then trailers (if any) and a blank line
                close = buffer.find(b"\r\n\r\n", line_end)
                if close < 0:
                    break
                pos = close + 4
                self.done = True
                break
            start, stop = line_end + 2, line_end + 2 + size
            if stop + 2 <= end_of_data:     # the whole chunk and its CRLF
                if not buffer.startswith(b"\r\n", stop):
                    raise UpstreamProtocolError("chunked body: no CRLF after a chunk")
                parts.append(buffer[start:stop])
                pos = stop + 2
                continue
            take = min(size, end_of_data - start)   # a chunk cut by the read: the rest comes later
            if take:
                parts.append(buffer[start:start + take])
            pos, size_left = start + take, size - take or -1
        self._chunk_left = size_left
        if pos:
            conn.take(pos, keep=False)
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


def _chunk_size(line: bytes | bytearray) -> int:
    """A chunk size line's hex size, chunk extensions after `;` ignored. Only hex digits, at most 16 (llhttp's
    limit): int() would also take a sign, spaces, "_" and "0x", where llhttp reads no size or another one."""
    digits = line.split(b";", 1)[0]
    if not 0 < len(digits) <= 16 or digits.translate(None, _HEX_DIGITS):
        raise UpstreamProtocolError("chunked body: bad chunk size")
    return int(digits, 16)
