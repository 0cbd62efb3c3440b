"""The HTTP calls the disaggregation tests make to real workers and the gateway in front of them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from tests.support.wait import await_until

if TYPE_CHECKING:
    from tests.backends.pd_cluster import Cluster


async def post(url: str, body: dict[str, Any], chat: bool = False) -> tuple[int, dict[str, Any]]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, orjson.loads(await r.read())


async def stream(url: str, body: dict[str, Any], chat: bool = False,
                 events: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The SSE events of one streamed request, appended to `events` (if given) as they arrive."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events = [] if events is None else events
    async with aiohttp.ClientSession() as s, s.post(url + path, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(orjson.loads(line[6:]))
    return events


async def post_json(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, orjson.loads(await r.read())


async def get(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return orjson.loads(await r.read())


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


async def holds_nothing(url: str) -> bool:
    return (await get(url + "/load"))["num_held_blocks"] == 0


async def assert_idle(worker_urls: list[str]) -> None:
    """No held blocks (unclaimed holds expire after pd_cluster.HOLD_TIMEOUT_S), every block free or cached-and-free."""
    async def idle() -> bool:
        loads = [await get(url + "/load") for url in worker_urls]
        return all(load["num_held_blocks"] == 0 and load["num_free_blocks"] == load["num_total_blocks"]
                   for load in loads)
    await await_until(idle, f"{worker_urls} to hold nothing")


async def assert_drained(cluster: Cluster, names: list[str]) -> None:
    """assert_idle for the named workers of a cluster."""
    await assert_idle([cluster.url(name) for name in names])
