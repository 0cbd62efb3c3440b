"""API keys, rate limits shared by two gateway replicas on one Redis (or a Redis Cluster), a Redis outage mid-run,
usage."""
from __future__ import annotations

import asyncio
import hashlib

import aiohttp

from tests.gateway.conftest import gateway_config
from tests.support.wait import await_until

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def keyed_config(fake_url: str, redis_url: str | None, max_requests_per_min: int) -> dict:
    return gateway_config({"p": [fake_url]}, redis_url=redis_url, api_keys=[
        {"key_id": "team-a", "key": "${TEAM_A_KEY}", "max_requests_per_min": max_requests_per_min},
        {"key_id": "ops", "key_sha256": hashlib.sha256(b"ops-secret").hexdigest(), "admin": True},
    ])


async def call(client: aiohttp.ClientSession, url: str, key: str | None) -> aiohttp.ClientResponse:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with client.post(url + CHAT, json=BODY, headers=headers) as response:
        await response.read()
        return response


async def test_keys_are_required_and_checked(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(keyed_config(fake.url, None, 100), env={"TEAM_A_KEY": "a-secret"})
    async with aiohttp.ClientSession() as client:
        for key in (None, "wrong"):
            response = await call(client, gateway.url, key)
            assert response.status == 401
        assert (await call(client, gateway.url, "a-secret")).status == 200
        assert (await call(client, gateway.url, "ops-secret")).status == 200
        async with client.get(gateway.url + "/v1/usage", headers={"Authorization": "Bearer a-secret"}) as r:
            usage = await r.json()
        async with client.get(gateway.url + "/v1/usage?key_id=ops",
                              headers={"Authorization": "Bearer a-secret"}) as r:
            assert r.status == 403
        async with client.get(gateway.url + "/v1/usage?key_id=team-a",
                              headers={"Authorization": "Bearer ops-secret"}) as r:
            assert (await r.json())["num_requests"] == 1
    assert usage["key_id"] == "team-a" and usage["num_requests"] == 1
    # The fake reports usage: 7 prompt tokens (3 cached), 3 completion tokens.
    assert (usage["num_prompt_tokens"], usage["num_cached_tokens"], usage["num_completion_tokens"]) == (7, 3, 3)
    assert fake.stats()["num_requests"] == 2


async def test_two_replicas_allow_exactly_the_shared_limit(start_fakes, start_gateway, shared_redis) -> None:
    """16 requests at once over two replicas under a limit of 10: 10 answers, 6 refusals, on one server and on
    a cluster named by one node's plain URL (which once let 16 of 16 through: each MOVED was taken for an
    outage, and each replica fell back to limits of its own)."""
    (fake,) = start_fakes("a")
    env = {"TEAM_A_KEY": "a-secret"}
    replicas = [start_gateway(keyed_config(fake.url, shared_redis.url, 10), env=env) for _ in range(2)]
    async with aiohttp.ClientSession() as client:
        responses = await asyncio.gather(*(call(client, replicas[i % 2].url, "a-secret") for i in range(16)))
    assert sorted(r.status for r in responses) == [200] * 10 + [429] * 6
    assert fake.stats()["num_requests"] == 10
    assert not any("shared state store unavailable" in r.log() for r in replicas)


async def test_rate_limit_is_shared_by_replicas_and_survives_a_redis_outage(start_fakes, start_gateway,
                                                                           redis_server) -> None:
    (fake,) = start_fakes("a")
    config = {**keyed_config(fake.url, redis_server.url, 6), "log_level": "INFO"}  # the store logs its switches
    env = {"TEAM_A_KEY": "a-secret"}
    replicas = [start_gateway(config, env=env), start_gateway(config, env=env)]
    async with aiohttp.ClientSession() as client:
        statuses = [(await call(client, replicas[i % 2].url, "a-secret")).status for i in range(6)]
        assert statuses == [200] * 6
        refused = await call(client, replicas[0].url, "a-secret")
        assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1
        assert (await call(client, replicas[1].url, "a-secret")).status == 429  # the other replica agrees

        redis_server.kill()
        # Requests keep being served during the outage (each replica falls back to local limits).
        during = [(await call(client, replicas[i % 2].url, key)).status
                  for i in range(4) for key in ("a-secret", "ops-secret")]
        assert during == [200] * 8

        redis_server.start()  # an empty Redis: the limits start over, shared again
        await await_until(lambda: all("shared state store is back" in r.log() for r in replicas),
                          "both replicas' stores to probe Redis and switch back")
        statuses = [(await call(client, replicas[i % 2].url, "a-secret")).status for i in range(8)]
    assert statuses[:6] == [200] * 6 and statuses[6:] == [429, 429]
    assert all(r.alive for r in replicas)
