"""Routing through real gateways: session affinity shared by two replicas on one Redis (stickiness,
bounded-load spill, re-homing), and least_tokens spreading by tokens rather than by counts."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from tests.gateway.conftest import gateway_config, metric
from tests.support.wait import await_until

CHAT = "/v1/chat/completions"


async def served_by(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    session: str | None = None) -> str:
    headers = {"x-session-affinity": session} if session else {}
    async with client.post(url + CHAT, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        raw = await response.read()
    if body.get("stream"):
        first = next(line for line in raw.split(b"\n\n") if line.startswith(b"data: {"))
        return orjson.loads(first[6:])["served_by"]
    return orjson.loads(raw)["served_by"]


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def test_session_affinity_across_two_replicas(start_fakes, start_gateway, shared_redis) -> None:
    fakes = start_fakes("e0", "e1", "e2")
    config = gateway_config({"p": [f.url for f in fakes]}, policy="session_affinity", redis_url=shared_redis.url)
    config["models"]["m"]["policy"]["options"] = {"load_factor": 1.25}
    replica1, replica2 = start_gateway(config), start_gateway(config)
    async with aiohttp.ClientSession() as client:
        # Stickiness: every turn of a session lands on one endpoint, whichever replica takes it.
        for session in ("alpha", "beta", "gamma", "delta"):
            homes = {await served_by(client, (replica1, replica2)[i % 2].url, chat(), session) for i in range(6)}
            assert len(homes) == 1, (session, homes)
        home = await served_by(client, replica1.url, chat(), "spill")
        home_fake = next(f for f in fakes if f.name == home)
        # Bounded load: while a long turn of the session is in flight at its home (held there until
        # the next turn is answered), the next turn spills to another endpoint and the session is re-homed there.
        slow = asyncio.create_task(served_by(client, replica1.url, chat(
            stream=True, fake={"chunks": 2, "first_chunk_gate": "long-turn"}), "spill"))
        await await_until(lambda: home_fake.num_waiting("long-turn") == 1, "the long turn to be in flight at home")
        moved_to = await served_by(client, replica1.url, chat(), "spill")
        home_fake.release("long-turn")
        assert await slow == home
        assert moved_to != home
        # The other replica reads the new assignment from Redis.
        assert await served_by(client, replica2.url, chat(), "spill") == moved_to
    assert metric(replica1, "switchyard_session_moves_total") == 1
    assert metric(replica2, "switchyard_routing_decisions_total", reason="affinity_hit") >= 1


async def test_least_tokens_spreads_by_tokens_not_counts(start_fakes, start_gateway) -> None:
    a, b = start_fakes("a", "b")
    config = gateway_config({"p": [a.url, b.url]}, policy="least_tokens")
    gateway = start_gateway(config)
    stall = {"chunks": 2, "first_chunk_gate": "held"}  # every turn stays in flight until the test lets it go

    def num_held() -> int:
        return a.num_waiting("held") + b.num_waiting("held")

    async with aiohttp.ClientSession() as client:
        # One long prompt (~2,000 tokens estimated) in flight ...
        long_turn = asyncio.create_task(served_by(client, gateway.url, chat("x" * 8000, stream=True, max_tokens=8,
                                                                            fake=stall)))
        await await_until(lambda: num_held() == 1, "the long turn to be in flight")
        # ... then six short ones: by request count they would alternate, by tokens they all avoid it.
        short = [asyncio.create_task(served_by(client, gateway.url, chat("hi", stream=True, max_tokens=8,
                                                                         fake=stall))) for _ in range(6)]
        await await_until(lambda: num_held() == 7, "all seven turns to be in flight")
        for fake in (a, b):
            fake.release("held", 7)
        long_home = await long_turn
        short_homes = await asyncio.gather(*short)
    assert set(short_homes) == {"b" if long_home == "a" else "a"}
