"""Admission (gateway/api/admission.py): a key's daily token quota (`max_tokens_per_day`), a bucket refilled over a
rolling day, asked before the per-minute limit and settled like it (in-process with a clock the test moves, and
shared by two gateway replicas through a real Redis); and the x-ratelimit-* headers of the per-minute limits."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from gateway.api.admission import DAILY_SUFFIX, charge_rate_limit, settle
from gateway.errors import RateLimited
from gateway.server.client_stream import StreamUsage
from gateway.server.key_auth import DAY_S, ApiKey
from gateway.state import MemoryStore
from tests.gateway.conftest import gateway_config
from tests.support.clock import ManualClock

KEY = ApiKey("k", b"\0" * 32, max_tokens_per_min=600, max_tokens_per_day=1000)


async def levels(store: MemoryStore) -> tuple[int | None, int | None]:
    """Tokens left today and this minute (an ask for zero tokens, with no request limit: it changes nothing)."""
    day = await store.rate_limit("k" + DAILY_SUFFIX, KEY.daily_limits, 0)  # type: ignore[arg-type]
    minute = await store.rate_limit("k", KEY.limits, 0)
    return day.remaining_tokens, minute.remaining_tokens


async def test_the_quota_is_asked_first_and_refunded_when_the_minute_refuses() -> None:
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    services: Any = SimpleNamespace(store=store)
    first = await charge_rate_limit(services, KEY, 500)
    assert first is not None and await levels(store) == (500, 100)
    with pytest.raises(RateLimited) as minute:             # 200 > the minute's 100 left: today keeps its 500
        await charge_rate_limit(services, KEY, 200)
    assert minute.value.code == "rate_limit_exceeded" and await levels(store) == (500, 100)
    clock.now += 60                                         # the minute is full again; the day gained 0.7
    assert await charge_rate_limit(services, KEY, 500) is not None and await levels(store) == (0, 100)
    with pytest.raises(RateLimited) as day:                 # the quota refuses: the minute is not spent
        await charge_rate_limit(services, KEY, 10)
    assert day.value.code == "insufficient_quota" and await levels(store) == (0, 100)
    wait_s = int(day.value.headers["Retry-After"])
    assert (10 - 1000 * 60 / DAY_S) * DAY_S / 1000 <= wait_s <= 10 * DAY_S / 1000 + 1
    await settle(services, first, 0, StreamUsage(num_prompt_tokens=60, num_output_tokens=40, exact=True))
    assert await levels(store) == (400, 500)                 # first used 100 of its 500: both refunded 400
    clock.now += wait_s
    assert await charge_rate_limit(services, KEY, 10) is not None


def test_a_limit_of_zero_fails_at_start_up() -> None:
    from gateway.config.gateway_config import ConfigError, parse_config

    for field in ("max_tokens_per_day", "max_tokens_per_min", "max_requests_per_min", "max_concurrent_requests"):
        text = f"""models: {{m: {{providers: [p]}}}}
providers: {{p: {{endpoints: ["http://h:1"]}}}}
api_keys: [{{key_id: a, key: s, {field}: 0}}]"""
        with pytest.raises(ConfigError, match=rf"api_keys\[0\]\.{field}: must be at least 1"):
            parse_config(text, {})


async def test_two_replicas_share_one_quota_through_redis(start_fakes, start_gateway, shared_redis) -> None:
    """The fake answers each request with usage of 10 tokens; a 45-token quota lets four or five through,
    whichever replica they reach (one more where a settlement, in the background with Redis, lags the next
    request), then refuses with `insufficient_quota` and a Retry-After in hours."""
    (fake,) = start_fakes("e0")
    config = gateway_config({"p": [fake.url]}, redis_url=shared_redis.url,
                            api_keys=[{"key_id": "k", "key": "sk-quota", "max_tokens_per_day": 45}])
    replicas = [start_gateway(config), start_gateway(config)]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    answers: list[tuple[int, dict[str, Any], str | None]] = []
    async with aiohttp.ClientSession() as client:
        for i in range(8):
            async with client.post(replicas[i % 2].url + "/v1/chat/completions", json=body,
                                   headers={"Authorization": "Bearer sk-quota"}) as response:
                answers.append((response.status, await response.json(), response.headers.get("Retry-After")))
            if response.status == 429:
                break
    served = [a for a in answers if a[0] == 200]
    status, refusal, retry_after = answers[-1]
    assert status == 429 and refusal["error"]["code"] == "insufficient_quota", answers
    assert 3 <= len(served) <= 6 and retry_after is not None and int(retry_after) > 3600
    assert fake.stats()["num_requests"] == len(served)
    async with aiohttp.ClientSession() as client, client.get(
            replicas[1].url + "/v1/usage", headers={"Authorization": "Bearer sk-quota"}) as response:
        usage = await response.json()
    assert usage["limits"]["max_tokens_per_day"] == 45 and usage["limits"]["max_tokens_per_min"] is None
    assert 0 <= usage["tokens_left_today"] < 10       # what the served requests' 10 tokens each left of 45


async def test_answers_carry_openai_rate_limit_headers(start_fakes, start_gateway) -> None:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} after the charge, on whole answers, streams, the
    Responses surface and the 429 itself; none for a key without per-minute limits."""
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, api_keys=[
        {"key_id": "k", "key": "sk-limited", "max_requests_per_min": 4, "max_tokens_per_min": 1000},
        {"key_id": "free", "key": "sk-free"}]))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    asks = [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
            ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 3})]
    async with aiohttp.ClientSession() as client:
        seen = []
        for path, body in asks:
            async with client.post(gateway.url + path, json=body, headers={"Authorization": "Bearer sk-limited"}) \
                    as response:
                await response.read()
                assert response.status == 200, path
                seen.append({k: v for k, v in response.headers.items() if k.startswith("x-ratelimit-")})
        assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["3", "2", "1"], seen
        for headers in seen:
            assert headers["x-ratelimit-limit-requests"] == "4" and headers["x-ratelimit-limit-tokens"] == "1000"
            assert 0 < int(headers["x-ratelimit-remaining-tokens"]) < 1000
            assert headers["x-ratelimit-reset-requests"].endswith("s")
        async with client.post(gateway.url + "/v1/chat/completions", json=chat,
                               headers={"Authorization": "Bearer sk-limited"}) as response:
            assert response.status == 200 and response.headers["x-ratelimit-remaining-requests"] == "0"
        async with client.post(gateway.url + "/v1/chat/completions", json=chat,
                               headers={"Authorization": "Bearer sk-limited"}) as response:
            assert response.status == 429 and response.headers["x-ratelimit-remaining-requests"] == "0"
        async with client.post(gateway.url + "/v1/chat/completions", json=chat,
                               headers={"Authorization": "Bearer sk-free"}) as response:
            assert response.status == 200 and not any(k.startswith("x-ratelimit-") for k in response.headers)
        for key, limits in (("sk-limited", {"max_requests_per_min": 4, "max_tokens_per_min": 1000}), ("sk-free", {})):
            async with client.get(gateway.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}) as response:
                usage = await response.json()
            assert usage["limits"] == {"max_requests_per_min": None, "max_tokens_per_min": None,
                                       "max_tokens_per_day": None, "max_concurrent_requests": None, "models": None,
                                       **limits} and "tokens_left_today" not in usage
