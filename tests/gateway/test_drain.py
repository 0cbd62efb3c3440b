"""SIGTERM under load: the gateway drains. Streams in flight finish whole, new requests get an
OpenAI-style 503 (the listener stays open: nothing is refused or reset), /ready turns 503, and the
process exits 0 once the last request ended. Nothing is lost or sent upstream twice."""
from __future__ import annotations

import asyncio
import signal

import aiohttp

from tests.gateway.conftest import gateway_config
from tests.support.wait import await_until

NUM_CHUNKS = 12


async def test_sigterm_drains_then_exits_zero(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(gateway_config({"p": [fake.url]}))
    held = {"chunks": NUM_CHUNKS, "first_chunk_gate": "drain"}  # each answer waits for the test's release

    async with aiohttp.ClientSession() as client:
        async def call(path: str, body: dict) -> tuple[int, str]:
            async with client.post(gateway.url + path, json={"model": "m", "max_tokens": 16, **body}) as response:
                return response.status, await response.text()

        chat = {"messages": [{"role": "user", "content": "hi"}]}
        calls = [call("/v1/chat/completions", {**chat, "stream": True, "fake": held}) for _ in range(3)]
        calls += [call("/v1/completions", {"prompt": "hi", "stream": True, "fake": held}) for _ in range(3)]
        calls += [call("/v1/chat/completions", {**chat, "fake": held})]
        tasks = [asyncio.create_task(c) for c in calls]
        await await_until(lambda: fake.num_waiting("drain") == len(tasks), "every request held upstream")

        gateway.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            async with client.get(gateway.url + "/ready") as response:
                return response.status == 503 and (await response.json())["status"] == "draining"
        await await_until(draining, "/ready to report the drain")
        async with client.post(gateway.url + "/v1/chat/completions", json={"model": "m", **chat}) as response:
            assert response.status == 503
            error = (await response.json())["error"]
            assert error["code"] == "shutting_down" and response.headers["Retry-After"] == "1"
        assert gateway.alive and not any(t.done() for t in tasks)  # still serving what it had

        fake.release("drain", len(tasks))
        results = await asyncio.gather(*tasks)

    words = "".join(f"tok{i} " for i in range(NUM_CHUNKS))
    for status, text in results[:-1]:
        assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
        assert "".join(_texts(text)) == words
    status, text = results[-1]
    assert status == 200 and words in text
    assert gateway.wait_exit() == 0
    assert fake.stats()["num_requests"] == len(tasks)  # the refused one never went upstream; none twice


def _texts(sse: str) -> list[str]:
    import orjson

    out = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            choice = orjson.loads(line[6:])["choices"][0]
            out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return out
