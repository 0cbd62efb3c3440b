"""Cancelled clients release their load leases at once: the in-flight gauges return to zero."""
from __future__ import annotations

import asyncio

import aiohttp

from tests.gateway.conftest import gateway_config, metric
from tests.support.wait import await_until

CHAT = "/v1/chat/completions"


async def test_cancelled_clients_release_their_leases(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    config = gateway_config({"p": [fake.url]}, keepalive_s=0.1)
    # The upstream never finishes (its gates stay shut) and no gateway timeout fires while the test
    # runs: only the clients going away can release the leases.
    config["providers"]["p"]["timeouts"] = {"connect_s": 1.0, "first_byte_s": 600.0, "total_s": 600.0}
    gateway = start_gateway(config)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "stream": True}
    async with aiohttp.ClientSession() as client:
        async def stalled() -> None:   # cancelled while the first token is awaited
            async with client.post(gateway.url + CHAT, json={**body, "fake": {"stall_gate": "stalled"}}) as response:
                await response.content.read()

        async def streaming() -> None:  # cancelled mid-stream
            async with client.post(gateway.url + CHAT,
                                   json={**body, "fake": {"chunks": 1000, "chunk_gate": "mid-stream"}}) as response:
                await response.content.read()

        tasks = [asyncio.create_task(stalled()) for _ in range(3)] + \
                [asyncio.create_task(streaming()) for _ in range(3)]
        await await_until(lambda: fake.stats()["waiting"] == {"stalled": 3, "mid-stream": 3},
                          "three requests stalled before the first token and three mid-stream")
        assert metric(gateway, "switchyard_inflight_requests", endpoint=fake.url) == 6
        assert metric(gateway, "switchyard_inflight_tokens", endpoint=fake.url) > 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await await_until(lambda: metric(gateway, "switchyard_inflight_requests", endpoint=fake.url) == 0
                      and metric(gateway, "switchyard_inflight_tokens", endpoint=fake.url) == 0,
                      "the cancelled requests' leases to be released")
    assert gateway.alive
