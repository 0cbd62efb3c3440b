"""Gateway throughput and added TTFT against a fast fake upstream, side by side with the fake alone.

Run: `.venv/bin/python -m tests.gateway.bench_throughput [--seconds 10] [--concurrency 64]`.
Closed loop: `concurrency` clients each send the next non-streaming request as soon as one returns.
Added TTFT: sequential streaming requests, time to the first data chunk, via the gateway minus direct.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import uvloop

from tests.gateway.conftest import gateway_config
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hello in five words."}],
                     "max_tokens": 16})
STREAM_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                            "fake": {"chunks": 2}})


async def closed_loop(url: str, seconds: float, concurrency: int) -> tuple[float, int]:
    done = 0
    errors = 0
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:
        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                async with client.post(url, data=BODY, headers={"Content-Type": "application/json"}) as response:
                    await response.read()
                    if response.status == 200:
                        done += 1
                    else:
                        errors += 1
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return done / elapsed, errors


async def ttft_ms(url: str, num_requests: int) -> list[float]:
    samples = []
    async with aiohttp.ClientSession() as client:
        for _ in range(num_requests):
            started = time.perf_counter()
            async with client.post(url, data=STREAM_BODY, headers={"Content-Type": "application/json"}) as response:
                await response.content.readany()
                samples.append((time.perf_counter() - started) * 1000)
                await response.read()
    return samples[num_requests // 10:]  # drop warm-up


async def run(seconds: float, concurrency: int, gateway_url: str, fake_url: str) -> None:
    path = "/v1/chat/completions"
    await closed_loop(gateway_url + path, 1.0, concurrency)  # warm-up
    direct_rps, _ = await closed_loop(fake_url + path, seconds, concurrency)
    gateway_rps, errors = await closed_loop(gateway_url + path, seconds, concurrency)
    direct_ttft = statistics.median(await ttft_ms(fake_url + path, 300))
    gateway_ttft = statistics.median(await ttft_ms(gateway_url + path, 300))
    print(f"non-streaming closed loop, concurrency {concurrency}, {seconds:.0f}s each:")
    print(f"  fake upstream alone : {direct_rps:8.0f} req/s")
    print(f"  through the gateway : {gateway_rps:8.0f} req/s  ({errors} errors)")
    print(f"streaming TTFT p50 (sequential): direct {direct_ttft:.3f} ms, via gateway {gateway_ttft:.3f} ms, "
          f"added {gateway_ttft - direct_ttft:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    fake = FakeUpstream("bench")
    with tempfile.TemporaryDirectory() as workdir:
        config = gateway_config({"p": [fake.url]}, policy="least_tokens")
        config["providers"]["p"]["upstream_model"] = None
        gateway = GatewayProcess(config, Path(workdir))
        try:
            uvloop.run(run(args.seconds, args.concurrency, gateway.url, fake.url))
        finally:
            gateway.stop()
            fake.stop()


if __name__ == "__main__":
    main()
