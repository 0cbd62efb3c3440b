"""Redis SIGKILLed and restarted under load (issue 11 §2, scenario 3): a gateway with `redis_url` keeps answering
every request during the outage, from its in-process fallback (gateway/state/resilient.py), with limits kept
per replica; once Redis is back on the same port, rate limits and session affinity live in Redis again.

tests/gateway/state/test_resilient.py covers the store on its own and tests/gateway/test_limits.py two
replicas' shared limit across an outage, one request at a time; this one keeps requests flowing while Redis
dies and returns, counts each at the upstreams, and checks sessions as well as limits after the recovery.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from gateway.state.redis_store import session_keys
from tests.faults.client import (
    Reply,
    assert_gateway_serves,
    assert_openai_error,
    assert_whole_answer,
    chat,
    new_request_id,
    post,
)
from tests.faults.conftest import Processes
from tests.faults.load import BACK_LOG, OUTAGE_LOG, Load
from tests.gateway.conftest import gateway_config
from tests.support.fake_faults import words
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProc
from tests.support.wait import await_until

LOAD_KEY, LIMITED_KEY = "sk-load", "sk-limited"
MAX_LIMITED_PER_MIN = 2   # refills one request per 30 s: nothing refills while the test runs


def _session_key(session: str) -> str:
    return session_keys("switchyard:", f"m\x00{session}")[0]   # RedisStore's key for the model's session


async def _in_session(gateway: GatewayProcess, session: str, sent: list[str]) -> str:
    """The name of the fake that served one request of `session`."""
    sent.append(new_request_id())
    reply = await post(gateway.url, chat("m", False), headers={
        "Authorization": f"Bearer {LOAD_KEY}", "x-session-affinity": session, "x-request-id": sent[-1]})
    assert_whole_answer(reply, words(3), stream=False)
    return str(reply.json()["served_by"])


async def _limited(gateway: GatewayProcess, sent: list[str]) -> list[Reply]:
    """One request more than the limited key's burst; the ids of those answered are added to `sent`."""
    replies = []
    for _ in range(MAX_LIMITED_PER_MIN + 1):
        request_id = new_request_id()
        replies.append(await post(gateway.url, chat("m", False), headers={
            "Authorization": f"Bearer {LIMITED_KEY}", "x-request-id": request_id}))
        if replies[-1].status == 200:
            sent.append(request_id)
    return replies


def _assert_limited(replies: list[Reply]) -> None:
    """The key's burst passes, the next request gets an OpenAI-style 429 with Retry-After."""
    assert [r.status for r in replies] == [200] * MAX_LIMITED_PER_MIN + [429]
    error = assert_openai_error(replies[-1], 429, "rate_limit_exceeded")
    assert error["type"] == "rate_limit_error" and int(replies[-1].headers["Retry-After"]) >= 1


@pytest.fixture
def fleet(procs: Processes, redis_server: RedisProc) -> tuple[list[FakeUpstream], GatewayProcess]:
    fakes = procs.fakes("a", "b")
    keys = [{"key_id": "load", "key": LOAD_KEY, "max_requests_per_min": 1_000_000},
            {"key_id": "limited", "key": LIMITED_KEY, "max_requests_per_min": MAX_LIMITED_PER_MIN}]
    # INFO: the store logs its switches; public metrics: the test reads the leases in flight without a key.
    config = gateway_config({"p": [f.url for f in fakes]}, policy="session_affinity", redis_url=redis_server.url,
                            api_keys=keys, limits={"metrics_public": True}, log_level="INFO")
    return fakes, procs.gateway(config)


@pytest.fixture
def admin(redis_server: RedisProc) -> Iterator[redis.Redis]:
    """The test's own client of the Redis server, to look at (and move) what the gateway keeps there."""
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
        yield client


async def test_redis_killed_and_restarted_under_load(fleet: tuple[list[FakeUpstream], GatewayProcess],
                                                     redis_server: RedisProc, admin: redis.Redis) -> None:
    fakes, gateway = fleet
    url_of = {fake.name: fake.url for fake in fakes}
    sent: list[str] = []   # ids of requests besides the load's that must reach an upstream
    home = await _in_session(gateway, "kept", sent)
    assert admin.hget(_session_key("kept"), "e") == url_of[home]

    load = Load([gateway.url], LOAD_KEY)
    running = asyncio.create_task(load.run())
    try:
        await load.wait_for_more(10, "requests to flow")
        redis_server.kill()
        await await_until(lambda: OUTAGE_LOG in gateway.log(), "the gateway to see the outage")
        await load.wait_for_more(20, "requests answered during the outage")
        _assert_limited(await _limited(gateway, sent))   # limits are kept in-process

        redis_server.start()   # the same port, empty
        await await_until(lambda: BACK_LOG in gateway.log(), "the gateway to switch back to Redis")
        await load.wait_for_more(10, "requests answered after the recovery")
    finally:
        load.stop()
        await running

    for _, stream, reply in load.replies:
        assert_whole_answer(reply, words(3), stream)

    # Limits are Redis's again: the restarted Redis is empty, so the key has its whole burst back
    # (the in-process bucket is spent), and the bucket is in Redis.
    _assert_limited(await _limited(gateway, sent))
    assert admin.exists("switchyard:rl:limited")
    # Sessions are Redis's again: a new one is written there, and Redis is what the gateway reads.
    first = await _in_session(gateway, "after", sent)
    assert admin.hget(_session_key("after"), "e") == url_of[first]
    other = next(name for name in url_of if name != first)
    admin.hset(_session_key("after"), "e", url_of[other])
    assert await _in_session(gateway, "after", sent) == other
    # The session from before the outage (gone with the old Redis; the load may have moved it meanwhile)
    # is back at its ring home.
    assert await _in_session(gateway, "kept", sent) == home

    # Each request answered ran exactly once upstream; the refused ones never got there.
    seen = [i for fake in fakes for i in fake.stats()["request_ids"]]
    assert sorted(seen) == sorted(sent + [i for i, _, _ in load.replies])
    assert gateway.log().count(OUTAGE_LOG) == 1   # one outage, no flapping after the recovery
    await assert_gateway_serves(gateway)
