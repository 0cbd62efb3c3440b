"""The response cache (gateway/routing/response_cache.py): which requests are the same, what is kept and for whom, and
two real gateway replicas sharing it through a real Redis in front of fake upstreams that count what reaches
them."""
from __future__ import annotations

import urllib.request
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.config.gateway_config import ModelConfig, ResponseCacheConfig
from gateway.errors import BadRequest
from gateway.routing.response_cache import CACHE_HEADER, TTL_HEADER, ResponseCache
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


def test_a_stream_is_never_the_same_as_a_whole_answer() -> None:
    c = cache()
    whole, stream = key_of(c, BODY), key_of(c, {**BODY, "stream": True})
    assert stream is not None and stream != whole
    assert key_of(c, {**BODY, "stream_options": {"include_usage": True}}) == whole   # meaningless unstreamed
    with_usage = key_of(c, {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert with_usage not in (None, stream, whole)                               # its events differ


def test_what_is_not_cached() -> None:
    c = cache()
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


async def test_two_replicas_share_answers_through_redis(start_fakes, start_gateway, shared_redis) -> None:
    (fake,) = start_fakes("e0")
    config = gateway_config({"p": [fake.url]}, redis_url=shared_redis.url, response_cache={"ttl_s": 60},
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
            assert r.status == 200 and r.headers[CACHE_HEADER] == "miss"
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
    assert shared_redis.keys("switchyard:resp:*"), "the answers live in Redis"


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


def test_a_whole_stream_is_replayed_and_a_broken_or_large_one_is_not_kept(start_fakes, start_gateway) -> None:
    """A stream's SSE bytes as its client got them, replayed byte for byte without the upstream. A stream cut
    short (an error event) or larger than `max_entry_bytes` is asked upstream again. The in-process store never
    suspends, so once a later answer is served from the cache, every earlier one that was kept is there too."""
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, response_cache={"ttl_s": 60, "max_entry_bytes": 2048}))
    good = {**BODY, "stream": True}
    broken = {**good, "fake": {"fault": "end_early", "at": 2}}
    large = {**good, "fake": {"chunks": 40}}          # about 5 kB of events

    def stream(body: dict[str, Any]) -> tuple[bytes, str | None]:
        request = urllib.request.Request(gateway.url + CHAT, data=orjson.dumps(body),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            return response.read(), response.headers.get(CACHE_HEADER)

    cut, state = stream(broken)
    assert state == "miss" and b'"error"' in cut and cut.endswith(b"data: [DONE]\n\n")
    big, state = stream(large)
    assert state == "miss" and len(big) > 2048 and big.endswith(b"data: [DONE]\n\n")
    first, state = stream(good)
    assert state == "miss" and streamed_words(first) == "tok0 tok1 tok2 "
    hit = wait_until(lambda: next((r for r in [stream(good)] if r[1] == "hit"), None), "a stream replayed")
    assert hit[0] == first                      # byte for byte: its ids, its usage, its [DONE]
    reached = fake.stats()["num_requests"]
    assert stream(good)[1] == "hit" and fake.stats()["num_requests"] == reached
    assert stream({**good, "stream_options": {"include_usage": True}})[1] == "miss"
    assert stream(broken)[1] == "miss" and stream(large)[1] == "miss"
    assert fake.stats()["num_requests"] >= reached + 3


def test_a_stream_on_another_surface_is_replayed_in_its_events(start_fakes, start_gateway) -> None:
    """/v1/messages keeps the chat stream it became (OpenAI's events) and re-encodes it again on a hit."""
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, response_cache={"ttl_s": 60}))
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}

    def stream() -> tuple[list[dict[str, Any]], str | None]:
        request = urllib.request.Request(gateway.url + "/v1/messages", data=orjson.dumps(body),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return sse_data(response.read()), response.headers.get(CACHE_HEADER)

    first, state = stream()
    assert state == "miss"
    hit, _ = wait_until(lambda: next((r for r in [stream()] if r[1] == "hit"), None), "a hit on /v1/messages")
    assert [e["type"] for e in hit] == [e["type"] for e in first]
    assert anthropic_text(hit) == anthropic_text(first) == "tok0 tok1 tok2 "
    assert hit[-1]["type"] == "message_stop"


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data:") and
            line.strip() != b"data: [DONE]"]


def streamed_words(raw: bytes) -> str:
    return "".join(c["delta"].get("content") or "" for e in sse_data(raw) for c in e.get("choices", ()))


def anthropic_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
