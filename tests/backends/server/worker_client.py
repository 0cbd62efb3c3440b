"""The HTTP calls the worker API tests make against one running worker: a JSON post, a stream's text, waiting
until the worker is idle or running, reading its /metrics counters. What the answers must be stays with the tests."""
from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from tests.support.wait import DEFAULT_TIMEOUT_S, await_until


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """A streamed completion's text and its last finish_reason."""
    text, finish = "", None
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Poll /load until nothing runs or waits and every block is free (cached ones count as free)."""
    async def idle() -> dict[str, Any] | None:
        async with session.get(f"{url}/load") as resp:
            report = await resp.json()
        quiet = report["num_running"] == 0 and report["num_waiting"] == 0
        return report if quiet and report["num_free_blocks"] == report["num_total_blocks"] else None
    return await await_until(idle, "the worker to be idle", timeout_s=timeout_s)


async def wait_running(session: aiohttp.ClientSession, url: str) -> None:
    async def running() -> bool:
        async with session.get(f"{url}/load") as resp:
            return (await resp.json())["num_running"] > 0
    await await_until(running, "the request to start running")


async def worker_metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """One unlabelled series of the worker's /metrics."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def num_generated(session: aiohttp.ClientSession, url: str) -> float:
    """Tokens the worker's engine has sampled so far (its /metrics counter)."""
    return await worker_metric(session, url, "switchyard_generation_tokens_total")
