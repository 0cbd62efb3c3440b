"""CPU per request through the gateway app in one process: the real app on its own site (the lean server
unless `--no-lean-http`), a fast in-process upstream (a fixed non-streaming completion) and concurrent
clients, timed with `time.process_time()` (client + gateway + upstream together), on uvloop as the gateway
runs. `--stream`: 32-chunk SSE answers. Less exposed to a shared machine's load than gateway_bench.py, so
it suits A/B runs of two checkouts: run it from each checkout's root, alternating.

    .venv/bin/python benchmarks/gateway_cpu_inprocess.py [--requests 4000] [--concurrency 8]
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
from gateway.config import parse_config
from gateway.serve import free_port

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


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def run(num_requests: int, concurrency: int, stream: bool, lean_http: bool) -> None:
    upstream_app = web.Application()
    upstream_app.add_routes([web.post(CHAT, _answer), web.get("/health", _health)])
    upstream = TestServer(upstream_app)
    await upstream.start_server()
    config = {"models": {"m": {"providers": ["p"], "policy": {"name": "least_tokens"}}},
              "providers": {"p": {"kind": "openai", "endpoints": [str(upstream.make_url("")).rstrip("/")]}}}
    port = free_port()
    config["listen"] = {"port": port, "lean_http": lean_http}
    gateway_config = parse_config(yaml.safe_dump(config), {})
    gateway = web.AppRunner(create_app(gateway_config))   # as `gateway.app.serve` runs it
    await gateway.setup()
    await make_site(gateway, gateway_config).start()
    url = f"http://127.0.0.1:{port}{CHAT}"
    body = orjson.dumps({**orjson.loads(BODY), "stream": stream})
    async with ClientSession(connector=TCPConnector(limit=0)) as session:
        async def client(num: int) -> None:
            for _ in range(num):
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                    assert response.status == 200, await response.text()
                    await response.read()

        await asyncio.gather(*[client(50) for _ in range(concurrency)])  # warm-up
        _tune_gc()  # as `gateway.app.serve` does after start-up
        cpu_s, wall_s = time.process_time(), time.perf_counter()
        await asyncio.gather(*[client(num_requests // concurrency) for _ in range(concurrency)])
        cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
    await gateway.cleanup()
    await upstream.close()
    num_done = num_requests // concurrency * concurrency
    kind = ("stream" if stream else "whole") + ("" if lean_http else ", aiohttp server")
    print(f"{os.getcwd()} {kind}: {cpu_s / num_done * 1e6:.1f} us CPU/req (client + gateway + upstream), "
          f"{num_done / wall_s:.0f} req/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--stream", action="store_true", help="32-chunk SSE answers instead of whole ones")
    parser.add_argument("--no-lean-http", dest="lean_http", action="store_false",
                        help="generation requests on aiohttp's server (`listen.lean_http: false`)")
    args = parser.parse_args()
    uvloop.run(run(args.requests, args.concurrency, args.stream, args.lean_http))


if __name__ == "__main__":
    main()
