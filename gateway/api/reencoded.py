"""A streamed answer re-encoded on its way to the client: whatever the dispatch writes (OpenAI chunks,
keepalives, error events) leaves through a translator (Anthropic's Messages events, the Responses API's
events), on either of the gateway's servers."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

from aiohttp import web

from gateway.server.lean_http import LeanProtocol, LeanRequest
from gateway.server.lean_stream import LeanSse


class EventTranslator(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...

    def close(self) -> bytes: ...


class _Reencoding(web.StreamResponse):
    """Writes go out translated, through the base response's own writes."""

    _events: EventTranslator

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        out = self._events.feed(bytes(data))
        if out:
            await super().write(out)

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(self._events.close() + data)   # close() is empty once the answer ended


class ReencodedResponse(_Reencoding):
    """The client's SSE response on aiohttp's server."""

    _send_headers_immediately = False   # the status line and headers leave with the first events

    def __init__(self, *, events: EventTranslator, status: int, headers: dict[str, str]) -> None:
        super().__init__(status=status, headers=headers)
        self._events = events


class LeanReencoded(_Reencoding, LeanSse):
    """The client's SSE response on the lean server (gateway/server/lean_http.py)."""

    def __init__(self, protocol: LeanProtocol, *, events: EventTranslator, status: int,
                 headers: dict[str, str]) -> None:
        super().__init__(protocol, status=status, headers=headers)
        self._events = events


def reencoded_response_class(request: web.Request) -> Callable[..., web.StreamResponse]:
    """The stream's class for the connection's server: the lean one writes to the transport itself."""
    return partial(LeanReencoded, request.protocol) if isinstance(request, LeanRequest) else ReencodedResponse
