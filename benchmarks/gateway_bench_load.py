"""The processes the gateway benchmark starts and the load it sends: the fake upstream, the bare relay,
the gateway's config, the closed- and open-loop load generators (run in a ProcessPoolExecutor, so they stay
module-level functions) and their PhaseResult. No measurement of CPU or memory and no reporting here."""
from __future__ import annotations

import asyncio
import random
import socket
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    import aiohttp

MODEL = "bench-model"
NUM_STREAM_TOKENS = 32


@dataclass(frozen=True, slots=True)
class PhaseResult:
    num_ok: int                      # 200 responses completed inside the measured window
    num_errors: int                  # non-200 or exceptions inside the measured window
    measured_s: float                # length of the measured window
    ttft_ms: tuple[float, ...]       # per request: first SSE data byte (streaming only)
    total_ms: tuple[float, ...]      # per request: whole response read


# --- the fake upstream ---------------------------------------------------------------------------

def _completion_body() -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * NUM_STREAM_TOKENS},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": NUM_STREAM_TOKENS,
                  "total_tokens": 12 + NUM_STREAM_TOKENS}})


def _stream_events() -> list[bytes]:
    def chunk(delta: dict, finish: str | None, usage: dict | None = None) -> bytes:
        body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"
    events = [chunk({"role": "assistant", "content": "tok "}, None)]
    events += [chunk({"content": "tok "}, None) for _ in range(NUM_STREAM_TOKENS - 1)]
    events.append(chunk({}, "length", {"prompt_tokens": 12, "completion_tokens": NUM_STREAM_TOKENS,
                                       "total_tokens": 12 + NUM_STREAM_TOKENS}))
    events.append(b"data: [DONE]\n\n")
    return events


def run_upstream(port: int, token_interval_s: float) -> None:
    """Serve /health and /v1/chat/completions on `port` until killed."""
    import uvloop
    from aiohttp import web

    completion, events = _completion_body(), _stream_events()

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=completion, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            if token_interval_s:
                await asyncio.sleep(token_interval_s)
        await response.write_eof()
        return response

    async def serve() -> None:
        app = web.Application()
        app.add_routes([web.get("/health", health), web.post("/v1/chat/completions", chat)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()  # until SIGTERM ends the process

    uvloop.run(serve())


def run_relay(port: int, upstreams: list[str]) -> None:
    """The floor for any Python gateway: a bare aiohttp pass-through (no parsing, no policy)."""
    import aiohttp
    import uvloop
    from aiohttp import web

    async def serve() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        turn = 0

        async def relay(request: web.Request) -> web.StreamResponse:
            nonlocal turn
            turn += 1
            body = await request.read()
            async with session.post(upstreams[turn % len(upstreams)] + "/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as upstream:
                if upstream.content_type != "text/event-stream":
                    return web.Response(status=upstream.status, body=await upstream.read(),
                                        content_type=upstream.content_type)
                response = web.StreamResponse(status=upstream.status, headers={
                    "Content-Type": upstream.headers.get("Content-Type", "application/json")})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        async def health(request: web.Request) -> web.Response:
            return web.Response(body=b'{"status":"ok"}', content_type="application/json")

        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", relay), web.get("/health", health)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()

    uvloop.run(serve())


def content_length(head: bytes) -> int:
    """Content-Length from a lower-cased HTTP head (0 without one)."""
    at = head.find(b"content-length:")
    if at < 0:
        return 0
    end = head.find(b"\r\n", at)
    return int(head[at + 15:end if end >= 0 else len(head)])


class _ByteRelay:
    """What the byte relay's connections share: the upstreams, each one's idle connections, whose turn it is."""

    def __init__(self, upstreams: list[str]) -> None:
        self.targets = [(url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1])) for url in upstreams]
        self.idle: list[list[_ByteRelayUpstream]] = [[] for _ in self.targets]
        self.connecting: set[asyncio.Task] = set()
        self.turn = 0


class _ByteRelayUpstream(asyncio.Protocol):
    def __init__(self, relay: _ByteRelay, index: int) -> None:
        self.relay, self.index, self.client, self.transport = relay, index, None, None
        self.head, self.left, self.tail = b"", -1, b""   # left: -1 in the head, -2 chunked, else bytes

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.relay.idle[self.index]:
            self.relay.idle[self.index].remove(self)
        elif self.client is not None:
            self.client.transport.close()

    def data_received(self, data: bytes) -> None:
        self.client.transport.write(data)
        if self.left == -1:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data, self.head = self.head[:end].lower(), self.head[end + 4:], b""
            self.left = -2 if b"transfer-encoding: chunked" in head else content_length(head)
        if self.left == -2:
            self.tail = (self.tail + data)[-5:]
            if self.tail == b"0\r\n\r\n":
                self.done()
        else:
            self.left -= len(data)
            if self.left <= 0:
                self.done()

    def done(self) -> None:
        self.client, self.left, self.tail = None, -1, b""
        self.relay.idle[self.index].append(self)


class _ByteRelayClient(asyncio.Protocol):
    def __init__(self, relay: _ByteRelay) -> None:
        self.relay = relay

    def connection_made(self, transport) -> None:
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        relay = self.relay
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        size = end + 4 + content_length(self.buffer[:end].lower())
        if len(self.buffer) < size:
            return
        request, self.buffer = self.buffer[:size], self.buffer[size:]
        relay.turn += 1
        index = relay.turn % len(relay.targets)
        if relay.idle[index]:
            self.send(relay.idle[index].pop(), request)
        else:
            task = asyncio.ensure_future(self.connect(index, request))
            relay.connecting.add(task)
            task.add_done_callback(relay.connecting.discard)

    async def connect(self, index: int, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(lambda: _ByteRelayUpstream(self.relay, index),
                                                   *self.relay.targets[index])
        self.send(upstream, request)

    def send(self, upstream: _ByteRelayUpstream, request: bytes) -> None:
        upstream.client = self
        upstream.transport.write(request)


def run_byte_relay(port: int, upstreams: list[str]) -> None:
    """A floor below the bare relay: each request's bytes and its answer's bytes passed through as they are,
    on uvloop protocols with no coroutine per request. It frames (Content-Length in; Content-Length or
    chunked out) and does nothing else: no parsing of the JSON, no routing but turns, no error handling."""
    import uvloop

    relay = _ByteRelay(upstreams)

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: _ByteRelayClient(relay), "127.0.0.1", port,
                                                                backlog=1024)
        await server.serve_forever()

    uvloop.run(serve())


# --- the load generators (run in worker processes) -----------------------------------------------

def _request_body(stream: bool) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": NUM_STREAM_TOKENS, "stream": stream,
                         "messages": [{"role": "user", "content": "Say something about switchyards."}]})


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> tuple[bool, float, float]:
    start = time.perf_counter()
    ttft = 0.0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        if stream:
            async for chunk in response.content.iter_any():
                if not ttft and b"data:" in chunk:
                    ttft = time.perf_counter() - start
        else:
            await response.read()
        ok = response.status == 200
    return ok, ttft * 1e3, (time.perf_counter() - start) * 1e3


def closed_loop(urls: list[str], concurrency: int, warmup_s: float, duration_s: float,
                stream: bool) -> PhaseResult:
    """`concurrency` clients each sending back to back; counts what completes in the window."""
    import aiohttp
    import uvloop

    async def main() -> PhaseResult:
        body = _request_body(stream)
        start = time.perf_counter()
        begin, end = start + warmup_s, start + warmup_s + duration_s
        ok, errors, ttfts, totals = 0, 0, [], []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def client(i: int) -> None:
                nonlocal ok, errors
                while time.perf_counter() < end:
                    try:
                        good, ttft, total = await _one(session, urls[i % len(urls)], body, stream)
                    except aiohttp.ClientError:
                        good, ttft, total = False, 0.0, 0.0
                    if begin <= time.perf_counter() < end:
                        ok += good
                        errors += not good
                        ttfts.append(ttft)
                        totals.append(total)
            await asyncio.gather(*(client(i) for i in range(concurrency)))
        return PhaseResult(ok, errors, duration_s, tuple(ttfts), tuple(totals))
    return uvloop.run(main())


def open_loop(urls: list[str], rate_per_s: float, warmup_s: float, duration_s: float, stream: bool,
              seed: int) -> PhaseResult:
    """Poisson arrivals at `rate_per_s` (seeded: the same schedule for direct and gateway)."""
    import aiohttp
    import uvloop

    async def main() -> PhaseResult:
        body, rng = _request_body(stream), random.Random(seed)
        results: list[tuple[bool, float, float]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def fire(i: int, measured: bool) -> None:
                try:
                    result = await _one(session, urls[i % len(urls)], body, stream)
                except aiohttp.ClientError:
                    result = (False, 0.0, 0.0)
                if measured:
                    results.append(result)
            start, at, i, tasks = time.perf_counter(), 0.0, 0, []
            while at < warmup_s + duration_s:
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(fire(i, at >= warmup_s)))
                i += 1
                at += rng.expovariate(rate_per_s)
            await asyncio.gather(*tasks)
        good = [r for r in results if r[0]]
        return PhaseResult(len(good), len(results) - len(good), duration_s,
                           tuple(r[1] for r in good), tuple(r[2] for r in good))
    return uvloop.run(main())


# --- ports, readiness, the gateway's config, percentiles ----------------------------------------

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port not handed out before in this run (servers bind theirs seconds later; the kernel may
    offer a port twice in between)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not answer 200 within {timeout_s} s")
        time.sleep(0.1)


def gateway_config(port: int, upstreams: list[str], policy: str, redis_url: str | None = None,
                   lean_http: bool = True) -> str:
    return orjson.dumps({  # JSON is YAML
        "listen": {"host": "127.0.0.1", "port": port, "lean_http": lean_http}, "redis_url": redis_url,
        "providers": {"fake": {"kind": "openai", "endpoints": upstreams, "health_path": "/health"}},
        "models": {MODEL: {"providers": ["fake"], "policy": {"name": policy}}},
        "ready": "each_model", "log_level": "WARNING",
    }).decode()


def percentile(values: tuple[float, ...], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def merge(parts: list[PhaseResult]) -> PhaseResult:
    """The results of several client processes' shares of one phase, as one."""
    return PhaseResult(sum(p.num_ok for p in parts), sum(p.num_errors for p in parts),
                       sum(p.measured_s for p in parts), sum((p.ttft_ms for p in parts), ()),
                       sum((p.total_ms for p in parts), ()))
