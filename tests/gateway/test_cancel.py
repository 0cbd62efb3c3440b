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


async def _usage(client: aiohttp.ClientSession, gateway_url: str) -> dict:
    async with client.get(gateway_url + "/v1/usage", headers={"Authorization": "Bearer k-secret"}) as response:
        assert response.status == 200
        return await response.json()


async def test_a_client_that_closes_after_done_was_served(start_fakes, start_gateway) -> None:
    """The OpenAI SDK closes its connection as soon as it reads `data: [DONE]`, often before the upstream's
    body has ended. That answer was served whole: it counts as a 200 with its inter-token latency, and its
    tokens are charged. A client that leaves mid-stream is a 499, charged for what was relayed to it."""
    (fake,) = start_fakes("a")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, api_keys=[{"key_id": "k", "key": "k-secret"}],
                                           limits={"metrics_public": True}))
    headers = {"Authorization": "Bearer k-secret"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    async with aiohttp.ClientSession() as client:
        async with client.post(gateway.url + CHAT, headers=headers,
                               json={**body, "fake": {"chunks": 4, "done_gate": "after-done"}}) as response:
            assert response.status == 200
            events = []
            async for line in response.content:   # read as an SDK does: up to [DONE], then close
                if line.startswith(b"data: "):
                    events.append(line)
                    if line.strip() == b"data: [DONE]":
                        break
        assert len(events) == 5
        await await_until(lambda: metric(gateway, "switchyard_requests_total", model="m") == 1,
                          "the closed stream to be counted")
        assert metric(gateway, "switchyard_requests_total", model="m", status="200") == 1
        assert metric(gateway, "switchyard_itl_seconds_count", model="m") == 1
        usage = await _usage(client, gateway.url)
        assert (usage["num_requests"], usage["num_completion_tokens"]) == (1, 4)
        fake.release("after-done")

        async with client.post(gateway.url + CHAT, headers=headers,
                               json={**body, "fake": {"chunks": 10, "chunk_gate": "mid"}}) as response:
            await response.content.readuntil(b"\n\n")
            fake.release("mid", 2)
            await response.content.readuntil(b"\n\n")
            await response.content.readuntil(b"\n\n")       # three content events, then the client leaves
        await await_until(lambda: metric(gateway, "switchyard_requests_total", model="m") == 2,
                          "the abandoned stream to be counted")
        assert metric(gateway, "switchyard_requests_total", model="m", status="499") == 1
        usage = await _usage(client, gateway.url)
        assert (usage["num_requests"], usage["num_completion_tokens"]) == (2, 4 + 3)
    assert gateway.alive
