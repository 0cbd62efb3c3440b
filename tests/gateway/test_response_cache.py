"""The response cache (gateway/response_cache.py): which requests are the same, what is kept and for whom, and
two real gateway replicas sharing it through a real Redis in front of fake upstreams that count what reaches
them."""
from __future__ import annotations

from typing import Any

import urllib.request

import aiohttp
import orjson
import pytest
import redis

from gateway.config import ModelConfig, ResponseCacheConfig
from gateway.errors import BadRequest
from gateway.response_cache import CACHE_HEADER, TTL_HEADER, ResponseCache
from gateway.state import MemoryStore
from tests.gateway.conftest import gateway_config, metric
from tests.support.clock import ManualClock
from tests.support.wait import await_until, wait_until

CHAT = "/v1/chat/completions"
M = ModelConfig(name="m", providers=("p",))
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8}


def cache(**config: Any) -> ResponseCache:
    return ResponseCache(ResponseCacheConfig(**{"ttl_s": 60.0, **config}), MemoryStore())


def key_of(c: ResponseCache, body: dict[str, Any], headers: dict[str, str] | None = None,
           key_id: str | None = "a") -> str | None:
    return c.plan(headers or {}, CHAT, M, body, key_id).key


def test_what_makes_two_requests_the_same() -> None:
    c = cache()
    base = key_of(c, BODY)
    assert base is not None
    reordered = dict(reversed(list(BODY.items())))
    assert key_of(c, {**reordered, "user": "u1", "stream": False, "metadata": {"x": 1}}) == base
    for changed in ({**BODY, "max_tokens": 9}, {**BODY, "messages": [{"role": "user", "content": "hi!"}]},
                    {**BODY, "seed": 1}, {**BODY, "tools": []}):
        assert key_of(c, changed) not in (None, base), changed
    assert c.plan({}, "/v1/completions", M, BODY, "a").key != base              # the route
    assert c.plan({}, CHAT, ModelConfig("m2", ("p",)), BODY, "a").key != base   # the model
    assert key_of(c, BODY, key_id="b") != base                                   # the API key...
    shared = cache(shared_across_keys=True)
    assert key_of(shared, BODY, key_id="a") == key_of(shared, BODY, key_id="b")  # ...unless shared


def test_what_is_not_cached() -> None:
    c = cache()
    assert key_of(c, {**BODY, "stream": True}) is None
    assert key_of(c, {**BODY, "temperature": 0.7}) is None                        # sampled
    assert key_of(c, {k: v for k, v in BODY.items() if k != "temperature"}) is None   # OpenAI's default: 1
    assert key_of(c, {**BODY, "temperature": 0.7, "seed": 3}) is not None          # seeded: repeatable
    assert key_of(cache(cache_sampled=True), {**BODY, "temperature": 0.7}) is not None
    assert key_of(c, BODY, {CACHE_HEADER: "skip"}) is None
    assert key_of(c, BODY, {TTL_HEADER: "0"}) is None
    refresh = c.plan({CACHE_HEADER: "refresh"}, CHAT, M, BODY, "a")
    assert refresh.key == key_of(c, BODY) and not refresh.read
    assert c.plan({TTL_HEADER: "5"}, CHAT, M, BODY, "a").ttl_s == 5.0
    for headers in ({CACHE_HEADER: "always"}, {TTL_HEADER: "-1"}, {TTL_HEADER: "soon"}, {TTL_HEADER: "1e9"}):
        with pytest.raises(BadRequest):
            c.plan(headers, CHAT, M, BODY, "a")


def test_a_model_sets_its_own_ttl() -> None:
    off = ResponseCache(ResponseCacheConfig(), MemoryStore())               # globally off...
    on = ModelConfig("m", ("p",), response_cache_ttl_s=30.0)
    assert not off.enabled_for(M) and off.enabled_for(on)                   # ...on for one model
    assert off.plan({}, CHAT, on, BODY, "a").ttl_s == 30.0
    c = cache()                                                             # globally on...
    assert not c.enabled_for(ModelConfig("m", ("p",), response_cache_ttl_s=0.0))   # ...off for one model
    assert c.plan({}, CHAT, ModelConfig("m", ("p",), response_cache_ttl_s=0.0), BODY, "a").key is None


async def test_only_whole_utf8_answers_within_the_size_limit_are_kept() -> None:
    c = cache(max_entry_bytes=100)
    plan = c.plan({}, CHAT, M, BODY, "a")
    for status, body in ((500, b"{}"), (200, b"x" * 101), (200, b"\xff\xfe"), (200, None)):
        await c.keep(plan, status, body)
        assert await c.read(plan) is None, (status, body)
    await c.keep(plan, 200, b'{"ok": true}')
    assert await c.read(plan) == b'{"ok": true}'


async def test_the_in_process_store_forgets_by_ttl_and_by_size_least_recent_first() -> None:
    clock = ManualClock()
    store = MemoryStore(clock=clock, max_response_bytes=30)
    await store.put_response("a", b"x" * 10, ttl_s=5)
    await store.put_response("b", b"y" * 10, ttl_s=50)
    assert await store.get_response("a") == b"x" * 10          # a is now the most recently used
    await store.put_response("c", b"z" * 15, ttl_s=50)          # 35 bytes: b, the least recent, goes
    assert await store.get_response("b") is None and await store.get_response("a") == b"x" * 10
    await store.put_response("big", b"w" * 31, ttl_s=50)        # larger than the whole bound: not kept
    assert await store.get_response("big") is None and await store.get_response("c") == b"z" * 15
    clock.now += 6
    assert await store.get_response("a") is None and await store.get_response("c") == b"z" * 15
    store.sweep()
    assert store.num_entries() == 1


async def ask(client: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str,
              headers: dict[str, str] | None = None) -> tuple[bytes, str | None]:
    async with client.post(url + CHAT, json=body, headers={"Authorization": f"Bearer {key}", **(headers or {})}
                           ) as response:
        assert response.status == 200, await response.text()
        return await response.read(), response.headers.get(CACHE_HEADER)


async def test_two_replicas_share_answers_through_redis(start_fakes, start_gateway, redis_server) -> None:
    (fake,) = start_fakes("e0")
    config = gateway_config({"p": [fake.url]}, redis_url=redis_server.url, response_cache={"ttl_s": 60},
                            api_keys=[{"key_id": "a", "key": "sk-a"}, {"key_id": "b", "key": "sk-b"}],
                            limits={"metrics_public": True})
    replica1, replica2 = start_gateway(config), start_gateway(config)

    def reached() -> int:
        return int(fake.stats()["num_requests"])

    async with aiohttp.ClientSession() as client:
        first, state = await ask(client, replica1.url, BODY, "sk-a")
        assert state == "miss" and reached() == 1

        async def cached() -> tuple[bytes, str | None] | None:   # kept in the background, after the answer
            again = await ask(client, replica2.url, {**dict(reversed(list(BODY.items()))), "user": "x"}, "sk-a")
            return again if again[1] == "hit" else None
        again, _ = await await_until(cached, "the answer to be served from the cache by the other replica")
        assert again == first               # byte for byte: the first answer's id and all
        before = reached()                  # (asks that came before the entry was kept reached it)
        assert (await ask(client, replica1.url, BODY, "sk-a"))[1] == "hit" and reached() == before
        assert (await ask(client, replica1.url, BODY, "sk-b"))[1] == "miss"      # another key: its own entry
        assert reached() == before + 1
        streamed = {**BODY, "stream": True}
        async with client.post(replica1.url + CHAT, json=streamed, headers={"Authorization": "Bearer sk-a"}) as r:
            assert r.status == 200 and CACHE_HEADER not in r.headers
            await r.read()
        assert reached() == before + 2
        for headers, body in (({CACHE_HEADER: "skip"}, BODY), ({}, {**BODY, "temperature": 0.5})):
            assert (await ask(client, replica1.url, body, "sk-a", headers))[1] == "bypass"
        assert reached() == before + 4
        # a short-lived entry of its own: served while it lives, asked upstream again once it is gone
        short = {**BODY, "max_tokens": 3}
        await ask(client, replica1.url, short, "sk-a", {TTL_HEADER: "0.5"})

        async def expired() -> bool:
            return (await ask(client, replica2.url, short, "sk-a"))[1] == "miss"
        await await_until(expired, "the short-lived entry to expire", timeout_s=30)
    assert metric(replica2, "switchyard_response_cache_total", result="hit") >= 1
    assert metric(replica1, "switchyard_response_cache_total", result="bypass") == 2
    assert redis.Redis.from_url(redis_server.url).keys("switchyard:resp:*"), "the answers live in Redis"


def test_without_redis_the_gateway_keeps_answers_itself(start_fakes, start_gateway) -> None:
    """The in-process store: a repeat is answered without the upstream, with the first answer's bytes."""
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, response_cache={"ttl_s": 60}))

    def post() -> tuple[bytes, str | None]:
        request = urllib.request.Request(gateway.url + CHAT, data=orjson.dumps(BODY),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read(), response.headers.get(CACHE_HEADER)

    first, state = post()
    assert state == "miss"
    hit = wait_until(lambda: next((r for r in [post()] if r[1] == "hit"), None), "a repeat served from the cache")
    assert hit[0] == first
    reached = fake.stats()["num_requests"]
    assert post()[1] == "hit" and fake.stats()["num_requests"] == reached


def test_the_anthropic_and_responses_surfaces_share_the_chat_requests_they_become(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, response_cache={"ttl_s": 60}))
    asks = {"/v1/messages": {"model": "m", "max_tokens": 8, "temperature": 0,
                             "messages": [{"role": "user", "content": "hi"}]},
            "/v1/responses": {"model": "m", "input": "hello", "max_output_tokens": 8, "temperature": 0}}
    for path, body in asks.items():
        def post(path: str = path, body: dict[str, Any] = body) -> tuple[dict[str, Any], str | None]:
            request = urllib.request.Request(gateway.url + path, data=orjson.dumps(body),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                return orjson.loads(response.read()), response.headers.get(CACHE_HEADER)

        first, state = post()
        assert state == "miss", path
        hit = wait_until(lambda post=post: next((r for r in [post()] if r[1] == "hit"), None), f"a hit on {path}")
        assert texts(hit[0]) == texts(first) and texts(first), (first, hit)


def texts(answer: dict[str, Any]) -> list[str]:
    """An Anthropic message's or a Response's text parts (their item ids are made afresh each time)."""
    if answer.get("type") == "message":
        return [block["text"] for block in answer["content"]]
    assert answer["object"] == "response", answer
    return [part["text"] for item in answer["output"] for part in item["content"]]
