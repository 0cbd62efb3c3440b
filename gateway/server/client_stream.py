"""The client side of a streamed (SSE) response: keepalive comments while the first token is awaited,
bytes relayed as they arrive (never buffered), error events after the first byte, token counting.

It never talks to upstreams; the dispatcher feeds it chunks. A client write failing means the client
went away: `ClientGone` propagates so the dispatcher closes the upstream at once.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import orjson
from aiohttp import web
from aiohttp.http_writer import StreamWriter

from gateway.server.lean_http import LeanRequest
from gateway.server.lean_stream import LeanSse
from gateway.server.middlewares import CORS_HEADERS
from gateway.telemetry.tracing import REQUEST_ID_HEADER, request_id_var

KEEPALIVE = b": keepalive\n\n"
WRITE_BUFFER_HIGH = 64 * 1024  # the relay waits for the client above this many unsent bytes (aiohttp's own limit)
DONE_EVENT = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed its connection; nothing more can be sent."""


@dataclass(slots=True)
class StreamUsage:
    num_output_tokens: int = 0           # content events seen (or usage.completion_tokens when sent)
    num_prompt_tokens: int | None = None  # from an upstream usage object, when present
    num_cached_tokens: int = 0           # usage.prompt_tokens_details.cached_tokens, when present
    exact: bool = False                  # True once a usage object replaced the event count

    @property
    def served(self) -> bool:
        """An upstream answered something to count: output, or a usage object (embeddings have no output)."""
        return bool(self.num_output_tokens or self.exact)

    def prompt_tokens(self, counted: int) -> int:
        """The upstream's prompt count, else the gateway's own (`counted`)."""
        return counted if self.num_prompt_tokens is None else self.num_prompt_tokens


class SseCounter:
    """Frames the relayed bytes into SSE events to count output tokens (one per content event) and
    pick up a usage object; it reads a copy of the stream, it never delays it."""

    __slots__ = ("_tail", "usage")

    def __init__(self) -> None:
        self._tail = b""
        self.usage = StreamUsage()

    def feed(self, chunk: bytes) -> int:
        """Returns the number of new content events in `chunk` (for shrinking the lease)."""
        if not self._tail and chunk.startswith(b"data: {") and chunk.find(b"\n\n") == len(chunk) - 2 \
                and b'"usage"' not in chunk:
            # Exactly one whole JSON event without usage (an engine's usual token chunk): two scans.
            num_new = 1
        else:
            # After a blank line (or at the start) more newlines are blank lines, not the start of an event.
            num_new = self._count(self._tail + chunk if self._tail else chunk.lstrip(b"\n"))
        if not self.usage.exact:
            self.usage.num_output_tokens += num_new
        return num_new

    def _count(self, data: bytes) -> int:
        """The whole events in `data` (up to its last blank line; the rest waits for more) counted with C-level
        scans, however many arrived together: the events that begin with a `data:` line, less [DONE] and
        usage-only ones. An event begins the stream or follows a blank line (a run of them is one, as SSE
        parses it)."""
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self._tail = data
            return 0
        self._tail = data[end:]
        num_new = data.startswith(b"data:", 0, end) + data.count(b"\n\ndata:", 0, end)
        if data.find(b"data: [DONE]", 0, end) >= 0:
            num_new -= data.startswith(b"data: [DONE]", 0, end) + data.count(b"\n\ndata: [DONE]", 0, end)
        at = data.find(b'"usage"', 0, end)
        while at >= 0:   # each event that mentions usage, once
            start, stop = data.rfind(b"\n\n", 0, at), data.find(b"\n\n", at)
            event = data[start + 2 if start >= 0 else 0:stop]
            if event.startswith(b"data:") and not event.startswith(b"data: [DONE]") and self._read_usage(event):
                num_new -= 1
            at = data.find(b'"usage"', stop, end)
        return num_new

    @property
    def mid_event(self) -> bool:
        """True when the bytes so far end inside an event (a cut stream must close it first)."""
        return bool(self._tail.strip())

    def _read_usage(self, event: bytes) -> bool:
        try:
            payload = orjson.loads(event[5:])
        except orjson.JSONDecodeError:
            return False
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if not isinstance(usage, dict):
            return False
        apply_usage(self.usage, usage)
        return not payload.get("choices")


def apply_usage(target: StreamUsage, usage: dict[str, object]) -> None:
    completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if isinstance(completion, int):
        target.num_output_tokens, target.exact = completion, True
    elif isinstance(prompt, int) and usage.get("total_tokens") == prompt:   # embeddings: a prompt, no output
        target.num_output_tokens, target.exact = 0, True
    if isinstance(prompt, int):
        target.num_prompt_tokens = prompt
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        target.num_cached_tokens = details["cached_tokens"]


def error_event(message: str, error_type: str = "upstream_error", code: str = "upstream_stream_failed") -> bytes:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


class _SseResponse(web.StreamResponse):
    """Holds the status line and headers back until the first body bytes, so that they leave in the
    same socket write (one syscall, one packet less per stream); aiohttp's own `web.Response` does this."""
    _send_headers_immediately = False

    def fast_writer(self) -> Callable[[bytes], bool]:
        """See `ClientStream.fast_writer`: the chunk framed for the transfer encoding, one transport write."""
        transport = self._req.transport if self._req is not None else None
        chunked = self._payload_writer_().chunked

        def write(chunk: bytes) -> bool:
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client closed its connection")
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            return transport.get_write_buffer_size() > WRITE_BUFFER_HIGH

        return write

    async def drain(self) -> None:
        await self._payload_writer_().drain()

    def _payload_writer_(self) -> StreamWriter:
        writer = self._payload_writer  # the connection's writer, which this response wrote its head to
        assert isinstance(writer, StreamWriter) and writer._compress is None
        return writer


# Builds the client's response from `status=` and `headers=`; another API surface passes one whose
# `write` re-encodes the OpenAI events it is given (gateway/api/messages.py).
SseResponseFactory = Callable[..., web.StreamResponse]


class ClientStream:
    """One client's SSE response. Headers go out with the first data or the first keepalive;
    until data has gone out, the dispatcher may still retry elsewhere."""

    def __init__(self, request: web.Request, keepalive_s: float,
                 new_response: SseResponseFactory | None = None) -> None:
        self._request = request
        self._keepalive_s = keepalive_s
        self.reencodes = new_response is not None   # another API's events, not OpenAI's SSE as relayed
        if new_response is None:   # the connection's own kind of stream
            new_response = partial(LeanSse, request.protocol) if isinstance(request, LeanRequest) else _SseResponse
        self._new_response: SseResponseFactory = new_response
        self._lock = asyncio.Lock()
        self.response: web.StreamResponse | None = None
        self.data_started = False
        self.first_data_s: float | None = None   # perf_counter when the first data went out (the access log's)
        self.ended = False               # the client has the stream's end (`data: [DONE]`): the answer is whole
        self.usage = StreamUsage()       # what has been relayed to the client, as the relay counts it
        self.extra_headers: dict[str, str] | None = None   # sent with the response's head
        self._recording: bytearray | None = None          # what `send` sent, while `record` asks for it
        self._max_recorded = 0
        self._timer: asyncio.TimerHandle | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self.arm_keepalive()

    @property
    def prepared(self) -> bool:
        return self.response is not None

    def arm_keepalive(self) -> None:
        if self._keepalive_s > 0 and not self.data_started:
            self._timer = asyncio.get_running_loop().call_later(self._keepalive_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self.data_started:
            self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive())

    async def _keepalive(self) -> None:
        async with self._lock:
            if self.data_started:
                return
            try:
                await self._ensure_prepared(200, "text/event-stream")
                await self.response.write(KEEPALIVE)  # type: ignore[union-attr]
            except (ConnectionError, RuntimeError):
                return  # the client went away; the handler is being cancelled
        self.arm_keepalive()

    async def _ensure_prepared(self, status: int, content_type: str) -> None:
        if self.response is None:
            headers = {"Content-Type": content_type, "Cache-Control": "no-cache",
                       REQUEST_ID_HEADER: request_id_var.get()}
            if self.extra_headers is not None:
                headers.update(self.extra_headers)
            if (cors := self._request.get(CORS_HEADERS)) is not None:
                headers.update(cors)
            response = self._new_response(status=status, headers=headers)
            await response.prepare(self._request)
            self.response = response

    async def send_first(self, chunk: bytes, content_type: str) -> None:
        """The first data bytes: from here on the request is committed to this upstream."""
        self.stop_keepalive()
        async with self._lock:
            self.data_started = True
            if self.first_data_s is None:
                self.first_data_s = time.perf_counter()
            try:
                await self._ensure_prepared(200, content_type)
            except ConnectionError as exc:
                raise ClientGone() from exc
            await self.send(chunk)

    def fast_writer(self) -> Callable[[bytes], bool] | None:
        """A synchronous write for a relay loop (after `send_first`): frames the chunk for the client's
        transfer encoding and hands it to the transport in one call, without aiohttp's per-write coroutine
        and bookkeeping. Returns True when the client's socket buffer is full: then `await drain()`.
        Raises ConnectionError where `send` raises ClientGone. None when the response has a write of
        its own (one that re-encodes the stream, e.g. /v1/messages), once the answer ended, or while `record`
        keeps what is sent: then the loop awaits `send`."""
        response = self.response
        if self.reencodes or self.ended or self._recording is not None \
                or not isinstance(response, (_SseResponse, LeanSse)):
            return None
        return response.fast_writer()

    async def drain(self) -> None:
        """Wait until the client has read enough of what `fast_writer` queued."""
        assert isinstance(self.response, (_SseResponse, LeanSse))
        await self.response.drain()

    async def send(self, chunk: bytes) -> None:
        """Relay `chunk`. The one that ends the answer (`data: [DONE]`) goes out with the body's end in the
        same write, where the response writes what it is given (not a re-encoding one): nothing follows it."""
        assert self.response is not None
        last = chunk.endswith(DONE_EVENT)
        if self._recording is not None:
            self._recording += chunk
            if len(self._recording) > self._max_recorded:
                self._recording = None
        try:
            if last and not self.reencodes:
                await self.response.write_eof(chunk)
            else:
                await self.response.write(chunk)
        except ConnectionError as exc:
            raise ClientGone() from exc
        if last:
            self.ended = True

    def record(self, max_bytes: int) -> None:
        """Keep the bytes `send` sends (not re-encoded), up to `max_bytes`, for `recorded`."""
        self._recording, self._max_recorded = bytearray(), max_bytes

    def recorded(self) -> bytes | None:
        """The whole answer as sent, when `record` kept it all and it reached its `data: [DONE]` without an
        error event; else None."""
        return bytes(self._recording) if self._recording is not None and self.ended else None

    async def fail(self, event: bytes, mid_event: bool = False) -> None:
        """End the stream with an error event and [DONE] (after headers went out)."""
        self._recording = None
        self.stop_keepalive()
        async with self._lock:
            self.data_started = True
            await self._ensure_prepared(200, "text/event-stream")
            await self.send((b"\n\n" if mid_event else b"") + event + DONE_EVENT)

    async def finish(self) -> web.StreamResponse:
        self.stop_keepalive()
        assert self.response is not None
        try:
            await self.response.write_eof()
        except ConnectionError as exc:
            raise ClientGone() from exc
        return self.response

    def stop_keepalive(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._keepalive_task is not None and self._keepalive_task.done():
            self._keepalive_task = None

    async def close(self) -> None:
        """Always called: no keepalive may outlive the request."""
        self.data_started = True
        self.stop_keepalive()
        task = self._keepalive_task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if (current := asyncio.current_task()) is not None and current.cancelling():
                    raise
