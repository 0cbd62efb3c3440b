"""The lean upstream client (gateway/upstream/http_client.py) against whatever an upstream may send and then close:
heads and bodies built from HTTP/1.1's parts with wrong values, cut anywhere. Each answer is a body or an
aiohttp client error (which the legs retry or report), within a deadline: never another exception, never a
hang."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gateway.upstream.http_client import UpstreamClient

TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=5)
NO_HANG_S = 10.0     # the server closes after its answer: anything still waiting by then is a hang

status_lines = st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 429 Too Many", b"HTTP/1.1 204 No",
                                b"HTTP/1.1 100 Continue", b"HTTP/1.1 2x0 OK", b"HTTP/2 200", b"HTTP/1.1", b"",
                                b"\x00\xff garbage"])
lengths = st.sampled_from([b"0", b"5", b"-1", b"-5", b"+3", b" 7 ", b"99999999999999999999", b"abc", b"0x10", b""])
chunk_sizes = st.sampled_from([b"5", b"-5", b"0", b"+5", b"5;ext", b"zz", b"", b"ffffffffffffffffffff", b"1_0"])
headers = st.lists(st.one_of(
    st.builds(lambda v: b"Content-Length: " + v, lengths),
    st.just(b"Transfer-Encoding: chunked"), st.just(b"Transfer-Encoding: gzip, chunked"),
    st.just(b"Connection: close"), st.just(b"Content-Type: text/event-stream"), st.just(b"no colon here"),
    st.binary(max_size=20)), max_size=4)
chunks = st.lists(st.builds(lambda size, data, end: size + b"\r\n" + data + end, chunk_sizes, st.binary(max_size=12),
                            st.sampled_from([b"\r\n", b"", b"XX"])), max_size=4)
last_chunks = st.sampled_from([b"0\r\n\r\n", b"0\r\nT: 1\r\n\r\n", b"0\r\n", b""])
bodies = st.one_of(st.binary(max_size=40), st.builds(lambda c, last: b"".join(c) + last, chunks, last_chunks))


@pytest.fixture(scope="module")
def answers() -> list[bytes]:
    return []   # the answer the server sends next (one request at a time)


@pytest.fixture
async def served(answers: list[bytes]) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(answers.pop())
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/x"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(status_lines, headers, bodies, st.integers(0, 400))
async def test_any_answer_then_close_is_a_body_or_a_client_error(
        served: str, answers: list[bytes], status: bytes, head_lines: list[bytes], body: bytes, cut: int) -> None:
    answer = b"\r\n".join([status, *head_lines]) + b"\r\n\r\n" + body
    answers.append(answer[:cut] if cut < len(answer) else answer)
    async with aiohttp.ClientSession() as session:
        client = UpstreamClient(session)
        try:
            async with asyncio.timeout(NO_HANG_S):
                try:
                    async with client.post(served, data=b"{}", headers={}, timeout=TIMEOUT) as response:
                        while await response.content.readany():
                            pass
                except aiohttp.ClientError:
                    pass    # what a leg turns into a retry or an error answer
        finally:
            client.close()
