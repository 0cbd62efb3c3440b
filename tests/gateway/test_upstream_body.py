"""gateway/upstream/connection.py's chunked body decoding against a reference decoder of the whole wire, for any
events, chunk extensions and trailers, with the bytes arriving in reads cut at any point."""
from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from gateway.upstream.connection import UpstreamBody, UpstreamConnection, UpstreamProtocolError
from gateway.upstream.deadlines import Deadlines

NEXT_RESPONSE = b"HTTP/1.1 200 OK\r\n"   # bytes after the body: the decoder must leave them in the buffer


def reference_decode(wire: bytes) -> tuple[bytes, int]:
    """(body, bytes the chunked body took) by RFC 9112 §7.1, on the whole wire at once."""
    body, pos = [], 0
    while True:
        line_end = wire.index(b"\r\n", pos)
        size = int(wire[pos:line_end].split(b";")[0], 16)
        pos = line_end + 2
        if size == 0:
            return b"".join(body), wire.index(b"\r\n\r\n", line_end) + 4
        body.append(wire[pos:pos + size])
        assert wire[pos + size:pos + size + 2] == b"\r\n"
        pos += size + 2


chunks = st.lists(st.binary(min_size=1, max_size=40), max_size=12)
extensions = st.sampled_from([b"", b";ext", b";a=b;c=\"d\""])
trailers = st.sampled_from([b"", b"X-Trailer: 1\r\n", b"A: b\r\nC: d\r\n"])


async def decode_in_reads(wire: bytes, cuts: list[int]) -> tuple[bytes, UpstreamBody, UpstreamConnection]:
    """Feed `wire` cut at `cuts` (one read each, delivered while the body waits for them), then the end of the
    connection (a body still waiting then fails); read the body."""
    conn = UpstreamConnection(Deadlines())
    body = UpstreamBody(conn, "chunked", 0)
    loop = asyncio.get_running_loop()
    bounds = [0, *sorted(set(cuts)), len(wire)]
    for start, stop in itertools.pairwise(bounds):
        if stop > start:
            loop.call_soon(conn.data_received, wire[start:stop])
    loop.call_soon(conn.eof_received)
    out = bytearray()
    while piece := await body.readany():
        out += piece
    return bytes(out), body, conn


@settings(max_examples=300, deadline=None)
@given(chunks, extensions, trailers, st.lists(st.integers(0, 2_000), max_size=12))
async def test_decoded_body_equals_the_reference_however_the_reads_fall(
        events: list[bytes], extension: bytes, trailer: bytes, cuts: list[int]) -> None:
    wire = b"".join(b"%x%b\r\n%b\r\n" % (len(e), extension, e) for e in events) + b"0\r\n" + trailer + b"\r\n"
    expected, num_body_bytes = reference_decode(wire + NEXT_RESPONSE)
    got, body, conn = await decode_in_reads(wire + NEXT_RESPONSE, [c % (len(wire) + 1) for c in cuts])
    assert got == expected == b"".join(events)
    assert body.done
    assert num_body_bytes == len(wire) and bytes(conn.buffer) == NEXT_RESPONSE


@pytest.mark.parametrize("wire", [
    b"-5\r\nabc\r\n0\r\n\r\n",          # int() takes a sign (the old decoder read "abc" as the next size)
    b"zz\r\nabc\r\n0\r\n\r\n",          # not hex
    b"3\r\nabcXY0\r\n\r\n",             # no CRLF after the data, in the same read
])
async def test_malformed_chunks_are_protocol_errors(wire: bytes) -> None:
    with pytest.raises(UpstreamProtocolError):
        await decode_in_reads(wire, [])


async def test_no_crlf_after_data_cut_across_reads_is_a_protocol_error() -> None:
    with pytest.raises(UpstreamProtocolError):
        await decode_in_reads(b"3\r\nabcXY0\r\n\r\n", [5, 7])
