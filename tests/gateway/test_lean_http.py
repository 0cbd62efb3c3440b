"""The lean HTTP/1.1 server (gateway/server/lean_http.py) in a real gateway process, spoken to over raw sockets:
what it serves itself (`Server: switchyard`), keep-alive and pipelining, streams in chunked framing, and
every request outside its subset handed, with the rest of its connection, to aiohttp's own server.

Already covered elsewhere, through this server too: a header line over `max_header_bytes`, more than
`max_headers` fields and a body over `max_body_bytes` (test_security.py::test_limits_answer_with_openai_errors),
and a head that never completes (test_security.py::test_slow_clients_cannot_hold_a_connection).
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import trustme
from multidict import CIMultiDict

from tests.gateway.conftest import gateway_config
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
WORDS = "tok0 tok1 tok2 "    # what the fake upstream answers by default (three chunks)
TIMEOUT_S = 30.0             # bounds a broken run only: every wait below ends on a condition
SECRET = "sk-lean-3c9f1a"


def post(body: Any = CHAT, *, path: str = CHAT_PATH, version: str = "HTTP/1.1", headers: tuple[str, ...] = ()) -> bytes:
    """A raw POST with a Content-Length body; `headers` are extra lines, sent as given (latin-1)."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    lines = [f"POST {path} {version}", "Host: gateway", "Content-Type: application/json",
             f"Content-Length: {len(raw)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + raw


@dataclass(frozen=True)
class Response:
    version: str                 # of the status line: HTTP/1.1 or HTTP/1.0
    status: int
    headers: CIMultiDict[str]
    body: bytes                  # de-chunked when it came chunked

    @property
    def lean(self) -> bool:
        """Written by the lean server (aiohttp's say `Server: Python/3.x aiohttp/...`)."""
        server = self.headers.get("Server", "")
        assert server == "switchyard" or "aiohttp/" in server, server
        return server == "switchyard"

    def json(self) -> Any:
        return orjson.loads(self.body)


class Connection:
    """One raw HTTP connection to the gateway."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> Response:
        return await asyncio.wait_for(self._response(), TIMEOUT_S)

    async def _response(self) -> Response:
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *lines = head[:-4].split("\r\n")
        version, status, _ = status_line.split(" ", 2)
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines:
            name, _, value = line.partition(":")
            headers.add(name, value.strip())
        if headers.get("Transfer-Encoding") == "chunked":
            body = await self._chunked_body()
        elif "Content-Length" in headers:
            body = await self.reader.readexactly(int(headers["Content-Length"]))
        else:
            body = await self.reader.read()
        return Response(version, int(status), headers, body)

    async def _chunked_body(self) -> bytes:
        """The chunks' data, up to and including the terminal `0\\r\\n\\r\\n` (no trailers expected)."""
        body = b""
        while True:
            size = int(await self.reader.readuntil(b"\r\n"), 16)
            data = await self.reader.readexactly(size + 2)
            assert data.endswith(b"\r\n"), data[-20:]
            if size == 0:
                return body
            body += data[:-2]

    async def closed_by_server(self) -> bytes:
        """What the server sent before it closed the connection (read to EOF)."""
        return await asyncio.wait_for(self.reader.read(), TIMEOUT_S)


@asynccontextmanager
async def connect(gateway: GatewayProcess, tls: ssl.SSLContext | None = None) -> AsyncIterator[Connection]:
    host, port = gateway.url.split("://")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port), ssl=tls)
    try:
        yield Connection(reader, writer)
    finally:
        writer.close()


def num_upstream(fake: FakeUpstream) -> int:
    return int(fake.stats()["num_requests"])


@pytest.fixture
def start(start_fakes, start_gateway) -> Callable[..., tuple[FakeUpstream, GatewayProcess]]:
    """One fake upstream and a gateway over it; keyword arguments go into the gateway's config."""
    def start(ca_file: str | None = None, **extra: Any) -> tuple[FakeUpstream, GatewayProcess]:
        (fake,) = start_fakes("a")
        kwargs = {"ca_file": ca_file} if ca_file else {}   # an https gateway's probes trust this CA
        return fake, start_gateway(gateway_config({"p": [fake.url]}, **extra), **kwargs)
    return start


def assert_chat_answer(response: Response, *, lean: bool) -> None:
    assert response.status == 200, response
    assert response.lean is lean
    assert response.json()["choices"][0]["message"]["content"] == WORDS
    assert response.json()["served_by"] == "a"


async def test_a_generation_request_is_answered_by_the_lean_server(start) -> None:
    fake, gateway = start()
    async with connect(gateway) as connection:
        await connection.send(post())
        chat = await connection.response()
        await connection.send(post({"model": "m", "prompt": "hi"}, path=COMPLETIONS_PATH))
        completion = await connection.response()
    for response in (chat, completion):
        assert (response.version, response.status, response.lean) == ("HTTP/1.1", 200, True)
        assert response.headers["Content-Type"] == "application/json"
        assert int(response.headers["Content-Length"]) == len(response.body)
        assert response.headers["x-request-id"] and "Connection" not in response.headers
        assert "Transfer-Encoding" not in response.headers
    assert_chat_answer(chat, lean=True)
    assert completion.json()["object"] == "text_completion" and completion.json()["choices"][0]["text"] == WORDS
    assert num_upstream(fake) == 2


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(start) -> None:
    fake, gateway = start()
    ids = [f"req-{i}" for i in range(4)]
    async with connect(gateway) as connection:
        responses = []
        for request_id in ids[:2]:      # one after the other on one connection
            await connection.send(post(headers=(f"x-request-id: {request_id}",)))
            responses.append(await connection.response())
        # Two in one send: a chat request, then a completions request; the answers come in that order.
        await connection.send(post(headers=(f"x-request-id: {ids[2]}",))
                              + post({"model": "m", "prompt": "hi"}, path=COMPLETIONS_PATH,
                                     headers=(f"x-request-id: {ids[3]}",)))
        responses += [await connection.response(), await connection.response()]
    assert [r.headers["x-request-id"] for r in responses] == ids
    assert all(r.status == 200 and r.lean for r in responses), responses
    assert [r.json()["object"] for r in responses] == ["chat.completion"] * 3 + ["text_completion"]
    assert num_upstream(fake) == 4


async def test_another_route_hands_the_connection_to_aiohttp_for_good(start) -> None:
    fake, gateway = start()
    async with connect(gateway) as connection:
        await connection.send(post())
        assert_chat_answer(await connection.response(), lean=True)
        await connection.send(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        health = await connection.response()
        assert (health.status, health.lean, health.json()["status"]) == (200, False, "ok")
        await connection.send(post())   # lean-shaped, but this connection is aiohttp's now
        after = await connection.response()
    assert_chat_answer(after, lean=False)
    assert after.headers["x-request-id"]
    assert num_upstream(fake) == 2


async def test_connection_close_is_answered_then_closed(start) -> None:
    _, gateway = start()
    async with connect(gateway) as connection:
        await connection.send(post(headers=("Connection: close",)))
        response = await connection.response()
        assert await connection.closed_by_server() == b""
    assert_chat_answer(response, lean=True)
    assert response.headers["Connection"] == "close"


async def test_a_head_and_body_in_separate_sends(start) -> None:
    fake, gateway = start()
    request = post()
    head_end = request.index(b"\r\n\r\n") + 4
    head, body = request[:head_end], request[head_end:]
    third = len(body) // 3
    async with connect(gateway) as connection:
        await connection.send(head)
        for piece in (body[:third], body[third:2 * third], body[2 * third:]):
            await asyncio.sleep(0.05)   # only to make the pieces separate segments: nothing waits on it
            await connection.send(piece)
        response = await connection.response()
        await connection.send(post())   # the connection goes on
        again = await connection.response()
    assert_chat_answer(response, lean=True)
    assert_chat_answer(again, lean=True)
    assert fake.stats()["last_body"]["messages"] == CHAT["messages"]


async def test_a_head_in_small_pieces_and_a_large_body(start) -> None:
    """A head in 7-byte sends (its blank line split across two reads) and a body of 800 kB (under the fake
    upstream's 1 MiB limit) in many reads: both put together exactly, the request served by the lean server."""
    fake, gateway = start()
    text = "".join(f"{i:07d} " for i in range(100_000))     # every offset distinct
    request = post({**CHAT, "messages": [{"role": "user", "content": text}]})
    head_end = request.index(b"\r\n\r\n") + 4
    async with connect(gateway) as connection:
        for at in range(0, head_end - 3, 7):
            await connection.send(request[at:min(at + 7, head_end - 3)])
        await asyncio.sleep(0.05)   # only to make the blank line's last 3 bytes a read of their own
        await connection.send(request[head_end - 3:head_end])    # "\n\r\n": the end straddles two reads
        await connection.send(request[head_end:])
        response = await connection.response()
    assert_chat_answer(response, lean=True)
    assert fake.stats()["last_body"]["messages"][0]["content"] == text


async def test_a_body_that_never_completes_gets_408_then_close(start) -> None:
    fake, gateway = start(limits={"body_timeout_s": 0.5})
    async with connect(gateway) as connection:
        await connection.send(post(b"{" + b" " * 99)[:-60])   # the head and 40 of the body's 100 bytes
        response = await connection.response()
        assert await connection.closed_by_server() == b""
    assert (response.status, response.lean, response.headers["Connection"]) == (408, True, "close")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_timeout", error
    assert response.headers["x-request-id"]
    assert num_upstream(fake) == 0


# Requests outside the lean subset: aiohttp parses and answers them (name, raw request, status).
HANDED_OVER = [
    ("two Content-Lengths", b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n"
                            b"Content-Length: 5\r\n\r\n%b" % (len(orjson.dumps(CHAT)), orjson.dumps(CHAT)), 400),
    ("Content-Length and chunked", b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 5\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
                                   % (len(orjson.dumps(CHAT)), orjson.dumps(CHAT)), 400),
    ("a chunked body", b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
                       % (len(orjson.dumps(CHAT)), orjson.dumps(CHAT)), 200),
    ("a control character in a value", post(headers=("X-Note: a\x01b",)), 400),
    ("HTTP/1.0", post(version="HTTP/1.0"), 200),
    # more digits than int() converts (4,300): it raised in the lean server's data callback, and the
    # connection closed with no answer
    ("a Content-Length of 5,000 digits", b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %b\r\n"
                                         b"\r\n{}" % (b"9" * 5000), 400),
]


async def test_requests_outside_the_lean_subset_are_served_by_aiohttp(start) -> None:
    fake, gateway = start()
    for name, request, status in HANDED_OVER:
        before = num_upstream(fake)
        async with connect(gateway) as connection:
            await connection.send(request)
            response = await connection.response()
        assert (response.status, response.lean) == (status, False), (name, response)
        if status == 200:
            assert_chat_answer(response, lean=False)
            assert response.version == ("HTTP/1.0" if name == "HTTP/1.0" else "HTTP/1.1"), name
        assert num_upstream(fake) == before + (status == 200), name   # a rejected one never went upstream


async def test_a_stream_goes_out_chunked_and_the_connection_goes_on(start) -> None:
    _, gateway = start()
    async with connect(gateway) as connection:
        await connection.send(post({**CHAT, "stream": True}))
        stream = await connection.response()   # reads the chunks up to the terminal 0\r\n\r\n
        await connection.send(post())
        after = await connection.response()
    assert (stream.status, stream.lean) == (200, True)
    assert stream.headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in stream.headers
    assert stream.headers["Content-Type"].startswith("text/event-stream") and stream.headers["x-request-id"]
    events = [e for e in stream.body.split(b"\n\n") if e and not e.startswith(b":")]
    assert events[-1] == b"data: [DONE]" and stream.body.endswith(b"\n\n"), stream.body[-80:]
    deltas = [orjson.loads(e.removeprefix(b"data: "))["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content", "") for d in deltas) == WORDS
    assert_chat_answer(after, lean=True)


async def test_over_tls_the_lean_server_hands_over_too(start, tmp_path) -> None:
    """On a TLS connection too: a lean request, then another route (aiohttp takes the connection over the TLS
    transport), then a lean-shaped request that aiohttp answers."""
    ca = trustme.CA()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued = ca.issue_cert("127.0.0.1")
    issued.private_key_and_cert_chain_pem.write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    fake, gateway = start(ca_file=str(tmp_path / "ca.pem"),
                          listen={"tls": {"cert_file": str(cert), "key_file": str(key)}})
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    async with connect(gateway, client_tls) as connection:
        await connection.send(post())
        first = await connection.response()
        await connection.send(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        health = await connection.response()
        await connection.send(post({**CHAT, "stream": True}))
        stream = await connection.response()
    assert_chat_answer(first, lean=True)
    assert (health.status, health.lean) == (200, False)
    assert (stream.status, stream.lean) == (200, False) and stream.body.endswith(b"data: [DONE]\n\n")
    assert num_upstream(fake) == 2


async def test_anthropic_messages_are_served_lean_whole_and_streamed(start) -> None:
    """POST /v1/messages too: a whole message, then a stream re-encoded into Anthropic's events, on one
    connection; an error keeps Anthropic's shape."""
    _, gateway = start()
    message = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}
    headers = ("anthropic-version: 2023-06-01",)
    async with connect(gateway) as connection:
        await connection.send(post(message, path="/v1/messages", headers=headers))
        whole = await connection.response()
        await connection.send(post({**message, "stream": True}, path="/v1/messages", headers=headers))
        stream = await connection.response()
        await connection.send(post({**message, "max_tokens": "many"}, path="/v1/messages", headers=headers))
        refused = await connection.response()
    assert (whole.status, whole.lean) == (200, True)
    assert whole.json()["type"] == "message" and whole.json()["content"][0]["text"] == WORDS
    assert (stream.status, stream.lean, stream.headers["Transfer-Encoding"]) == (200, True, "chunked")
    events = [orjson.loads(e.split(b"\ndata: ", 1)[1]) for e in stream.body.split(b"\n\n") if e.startswith(b"event:")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", events
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == WORDS
    assert (refused.status, refused.lean, refused.json()["type"]) == (400, True, "error")


async def test_with_lean_http_off_aiohttp_answers(start) -> None:
    """aiohttp's server answers everything, a stream too (its last chunk and the body's end in one write), and
    the connection goes on after it."""
    fake, gateway = start(listen={"lean_http": False})
    async with connect(gateway) as connection:
        await connection.send(post())
        response = await connection.response()
        await connection.send(post({**CHAT, "stream": True}))
        stream = await connection.response()
        await connection.send(post())
        after = await connection.response()
    assert_chat_answer(response, lean=False)
    assert (stream.status, stream.lean, stream.headers["Transfer-Encoding"]) == (200, False, "chunked")
    assert stream.body.endswith(b"data: [DONE]\n\n"), stream.body[-80:]
    assert_chat_answer(after, lean=False)
    assert num_upstream(fake) == 3


async def test_a_key_is_checked_on_the_lean_server(start) -> None:
    fake, gateway = start(api_keys=[{"key_id": "team", "key": SECRET}])
    async with connect(gateway) as connection:
        await connection.send(post())
        refused = await connection.response()
        await connection.send(post(headers=(f"Authorization: Bearer {SECRET}",)))   # same connection
        admitted = await connection.response()
    assert (refused.status, refused.lean) == (401, True)
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert refused.headers["x-request-id"]
    assert_chat_answer(admitted, lean=True)
    assert num_upstream(fake) == 1


async def test_an_early_answer_reaches_a_client_still_sending_its_body(start) -> None:
    """The server reads and drops the rest of the body before it closes (RFC 9112 §9.6): a close with request
    bytes unread resets the connection, and the client would never read the answer."""
    fake, gateway = start(api_keys=[{"key_id": "team", "key": SECRET}], max_body_bytes=32 << 20)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (12 << 20)}]}   # more than the socket buffers
    async with connect(gateway) as connection:
        await connection.send(post(big))    # no key: the 401 is due as soon as the head arrives
        response = await connection.response()
        assert await connection.closed_by_server() == b""
    assert (response.status, response.lean) == (401, True)
    assert response.headers["Connection"] == "close"
    assert num_upstream(fake) == 0
