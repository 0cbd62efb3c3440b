"""CPU per request through the gateway app in one process: the real app on its own site (the lean server
unless `--no-lean-http`), a fast in-process upstream (a fixed non-streaming completion) and concurrent
clients, timed with `time.process_time()` (client + gateway + upstream together), on uvloop as the gateway
runs. `--stream`: 32-chunk SSE answers. Less exposed to a shared machine's load than gateway_bench.py, so
it suits A/B runs of two checkouts: run it from each checkout's root, alternating.

`--bare-peers`: the client and the upstream are bare uvloop protocols that write canned bytes (a few µs a
request), so nearly all of the CPU measured is the gateway's own: the instrument for changes of a few percent.

    .venv/bin/python benchmarks/gateway_cpu_inprocess.py [--requests 4000] [--concurrency 8] [--bare-peers]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout it is run from, not the one it lives in

import orjson
import uvloop
import yaml
from aiohttp import ClientSession, TCPConnector, web
from aiohttp.test_utils import TestServer

from gateway.app import _tune_gc, create_app, make_site
from gateway.config.gateway_config import parse_config
from gateway.ops.supervisor import free_port
from gateway_bench_load import content_length  # beside this script

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8})
ANSWER = orjson.dumps({
    "id": "x", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})


STREAM = [b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [
    {"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}) + b"\n\n" for _ in range(32)]
STREAM.append(b"data: [DONE]\n\n")


async def _answer(request: web.Request) -> web.StreamResponse:
    if not orjson.loads(await request.read()).get("stream"):
        return web.Response(body=ANSWER, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in STREAM:  # 32 chunks, each its own write (as an engine streams them)
        await response.write(event)
        await asyncio.sleep(0)
    await response.write_eof()
    return response


class _BareUpstream(asyncio.Protocol):
    """Answers each request with canned bytes: the whole completion, or the 33 events as chunks, one per
    loop turn (as an engine streams them), or with `together` all in one write (as events that were ready
    together, gateway_bench.py's `--token-interval-ms 0`)."""

    def __init__(self, together: bool = False) -> None:
        self.together = together

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            size = end + 4 + content_length(self.buffer[:end].lower())
            if len(self.buffer) < size:
                return
            request, self.buffer = self.buffer[:size], self.buffer[size:]
            if request.startswith(b"GET"):
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            elif b'"stream":true' in request:
                head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n")
                if self.together:
                    self.transport.write(head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in STREAM)
                                         + b"0\r\n\r\n")
                else:
                    self.transport.write(head)
                    self._send_events(0)
            else:
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                     + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)

    def _send_events(self, index: int) -> None:
        if self.transport.is_closing():
            return
        if index == len(STREAM):
            self.transport.write(b"0\r\n\r\n")
            return
        self.transport.write(b"%x\r\n%s\r\n" % (len(STREAM[index]), STREAM[index]))
        asyncio.get_running_loop().call_soon(self._send_events, index + 1)


class _BareClient(asyncio.Protocol):
    """Sends `left` requests one after another on one keep-alive connection, each once the last answer
    (Content-Length or chunked) is whole."""

    def __init__(self, request: bytes, left: int, done: asyncio.Future) -> None:
        self.request, self.left, self.done = request, left, done
        self.buffer, self.need, self.at = b"", -1, 0   # need: -1 in the head, -2 chunked (at: next size line)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.need == -1:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            assert head.startswith(b"http/1.1 200"), head
            self.buffer, self.at = self.buffer[end + 4:], 0
            self.need = -2 if b"transfer-encoding: chunked" in head else content_length(head)
        if not self._whole():
            return
        self.buffer, self.need, self.left = b"", -1, self.left - 1
        if self.left:
            self.transport.write(self.request)
        else:
            self.transport.close()
            self.done.set_result(None)

    def _whole(self) -> bool:
        if self.need >= 0:
            return len(self.buffer) >= self.need
        while (line_end := self.buffer.find(b"\r\n", self.at)) >= 0:
            size = int(self.buffer[self.at:line_end], 16)
            if size == 0:
                return len(self.buffer) >= line_end + 4
            self.at = line_end + 2 + size + 2
        return False


async def _bare_clients(port: int, body: bytes, num: int, concurrency: int) -> None:
    loop = asyncio.get_running_loop()
    request = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    done = [loop.create_future() for _ in range(concurrency)]
    for future in done:
        await loop.create_connection(lambda f=future: _BareClient(request, num, f), "127.0.0.1", port)
    await asyncio.gather(*done)


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def run(num_requests: int, concurrency: int, stream: bool, lean_http: bool, bare: bool,
              together: bool = False, access_log: str | None = None) -> None:
    if bare:
        upstream_port = free_port()
        bare_upstream = await asyncio.get_running_loop().create_server(
            lambda: _BareUpstream(together), "127.0.0.1", upstream_port)
        upstream_url = f"http://127.0.0.1:{upstream_port}"
    else:
        upstream_app = web.Application()
        upstream_app.add_routes([web.post(CHAT, _answer), web.get("/health", _health)])
        upstream = TestServer(upstream_app)
        await upstream.start_server()
        upstream_url = str(upstream.make_url("")).rstrip("/")
    config = {"models": {"m": {"providers": ["p"], "policy": {"name": "least_tokens"}}},
              "providers": {"p": {"kind": "openai", "endpoints": [upstream_url]}}}
    port = free_port()
    config["listen"] = {"port": port, "lean_http": lean_http}
    if access_log is not None:
        config["access_log"] = access_log
    gateway_config = parse_config(yaml.safe_dump(config), {})
    gateway = web.AppRunner(create_app(gateway_config))   # as `gateway.app.serve` runs it
    await gateway.setup()
    await make_site(gateway, gateway_config).start()
    url = f"http://127.0.0.1:{port}{CHAT}"
    body = orjson.dumps({**orjson.loads(BODY), "stream": stream})
    if bare:
        await _bare_clients(port, body, 50, concurrency)   # warm-up
        _tune_gc()  # as `gateway.app.serve` does after start-up
        cpu_s, wall_s = time.process_time(), time.perf_counter()
        await _bare_clients(port, body, num_requests // concurrency, concurrency)
        cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
    else:
        async with ClientSession(connector=TCPConnector(limit=0)) as session:
            async def client(num: int) -> None:
                for _ in range(num):
                    async with session.post(url, data=body,
                                            headers={"Content-Type": "application/json"}) as response:
                        assert response.status == 200, await response.text()
                        await response.read()

            await asyncio.gather(*[client(50) for _ in range(concurrency)])  # warm-up
            _tune_gc()  # as `gateway.app.serve` does after start-up
            cpu_s, wall_s = time.process_time(), time.perf_counter()
            await asyncio.gather(*[client(num_requests // concurrency) for _ in range(concurrency)])
            cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
    await gateway.cleanup()
    if bare:
        bare_upstream.close()
    else:
        await upstream.close()
    num_done = num_requests // concurrency * concurrency
    kind = ("stream" if stream else "whole") + ("" if lean_http else ", aiohttp server")
    kind += ", bare peers" if bare else ""
    kind += ", events together" if together else ""
    print(f"{os.getcwd()} {kind}: {cpu_s / num_done * 1e6:.1f} us CPU/req (client + gateway + upstream), "
          f"{num_done / wall_s:.0f} req/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--stream", action="store_true", help="32-chunk SSE answers instead of whole ones")
    parser.add_argument("--no-lean-http", dest="lean_http", action="store_false",
                        help="generation requests on aiohttp's server (`listen.lean_http: false`)")
    parser.add_argument("--bare-peers", action="store_true",
                        help="client and upstream as bare protocols writing canned bytes: the gateway's CPU alone")
    parser.add_argument("--events-together", action="store_true",
                        help="with --stream --bare-peers: the upstream writes a stream's 33 events in one write")
    parser.add_argument("--access-log", metavar="PATH", help="the gateway writes its access log there")
    args = parser.parse_args()
    if args.events_together and not (args.stream and args.bare_peers):
        parser.error("--events-together needs --stream and --bare-peers")
    uvloop.run(run(args.requests, args.concurrency, args.stream, args.lean_http, args.bare_peers, args.events_together,
                   args.access_log))


if __name__ == "__main__":
    main()
