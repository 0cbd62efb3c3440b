"""Cancelled clients release their load leases at once: the in-flight gauges return to zero."""
from __future__ import annotations

import asyncio

import aiohttp

from tests.gateway.conftest import gateway_config, metric

CHAT = "/v1/chat/completions"


async def test_cancelled_clients_release_their_leases(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, keepalive_s=0.1))
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "stream": True}
    async with aiohttp.ClientSession() as client:
        async def stalled() -> None:   # cancelled while the first token is awaited
            async with client.post(gateway.url + CHAT, json={**body, "fake": {"stall_s": 30}}) as response:
                await response.content.read()

        async def streaming() -> None:  # cancelled mid-stream
            async with client.post(gateway.url + CHAT,
                                   json={**body, "fake": {"chunks": 1000, "chunk_delay_s": 0.05}}) as response:
                await response.content.read()

        tasks = [asyncio.create_task(stalled()) for _ in range(3)] + \
                [asyncio.create_task(streaming()) for _ in range(3)]
        await asyncio.sleep(1.0)
        assert metric(gateway, "switchyard_inflight_requests", endpoint=fake.url) == 6
        assert metric(gateway, "switchyard_inflight_tokens", endpoint=fake.url) > 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.5)
    assert metric(gateway, "switchyard_inflight_requests", endpoint=fake.url) == 0
    assert metric(gateway, "switchyard_inflight_tokens", endpoint=fake.url) == 0
    assert gateway.alive
