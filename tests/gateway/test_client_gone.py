"""A client that leaves while its stream is relayed is `ClientGone` (the request ends as the client's
leaving), never a connection error that the legs would count against the upstream and fail over from.
What the client's side raises depends on how it left and on the server: a reset or a broken pipe from a
write, and, on aiohttp's server, a plain `ConnectionError("Connection lost")` from a drain that was
waiting when the client reset (aiohttp/base_protocol.py, `connection_lost`)."""
from __future__ import annotations

import pytest

from gateway.server.client_stream import ClientGone
from gateway.upstream.relay import _drain, _write

LEFT = [ConnectionResetError("reset"), BrokenPipeError("broken pipe"), ConnectionError("Connection lost")]


class _Client:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def drain(self) -> None:
        raise self.exc

    def fast_write(self, chunk: bytes) -> bool:
        raise self.exc


@pytest.mark.parametrize("exc", LEFT, ids=lambda e: type(e).__name__)
async def test_a_client_gone_from_a_drain_is_client_gone(exc: BaseException) -> None:
    with pytest.raises(ClientGone):
        await _drain(_Client(exc))   # type: ignore[arg-type]


@pytest.mark.parametrize("exc", LEFT, ids=lambda e: type(e).__name__)
def test_a_client_gone_from_a_write_is_client_gone(exc: BaseException) -> None:
    with pytest.raises(ClientGone):
        _write(_Client(exc).fast_write, b"data: x\n\n")
