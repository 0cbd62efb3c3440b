"""Failover between endpoints and providers, Retry-After, client errors relayed, circuit breakers."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.gateway.conftest import gateway_config, metric
from tests.support.wait import await_until

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def send_many(url: str, num_requests: int, concurrency: int = 4, stream: bool = False,
                    between: Any = None) -> list[tuple[int, bytes]]:
    """`num_requests` requests, `concurrency` at a time; `between(i)` runs before request i."""
    results: list[tuple[int, bytes]] = []
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as client:
        async def one(i: int) -> None:
            async with semaphore:
                if between is not None:
                    await between(i)
                body = {**BODY, "stream": stream}
                async with client.post(url + CHAT, json=body) as response:
                    results.append((response.status, await response.read()))
        await asyncio.gather(*(one(i) for i in range(num_requests)))
    return results


@pytest.mark.parametrize("stream", [False, True])
async def test_no_request_lost_while_one_endpoint_returns_500(start_fakes, start_gateway, stream: bool) -> None:
    (bad,) = start_fakes("bad", behaviour={"status": 500})
    (good,) = start_fakes("good")
    # Not a test of the retry budget (10 + 20% of requests): round robin may send more than half of
    # the first attempts to `bad`, so a budget-sized allowance would make this test flaky.
    retries = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "backoff_jitter_s": 0.01, "budget_min_retries": 1000}
    gateway = start_gateway(gateway_config({"p": [bad.url, good.url]}, breaker={"failure_threshold": 1000},
                                           retries=retries))
    results = await send_many(gateway.url, 20, stream=stream)
    assert [status for status, _ in results] == [200] * 20
    assert all(b"tok2" in body for _, body in results)
    assert bad.stats()["num_requests"] >= 3  # round robin really sent some there
    assert good.stats()["num_requests"] == 20
    assert metric(gateway, "switchyard_retries_total") >= 3


async def test_no_request_lost_when_an_upstream_dies(start_fakes, start_gateway) -> None:
    a, b = start_fakes("a", "b")
    gateway = start_gateway(gateway_config({"p": [a.url, b.url]}))

    async def kill_a_midway(i: int) -> None:
        if i == 10:
            a.kill()

    results = await send_many(gateway.url, 40, stream=True, between=kill_a_midway)
    assert [status for status, _ in results] == [200] * 40
    assert b.stats()["num_requests"] >= 20


async def test_falls_back_to_the_next_provider(start_fakes, start_gateway) -> None:
    (bad,) = start_fakes("bad", behaviour={"status": 503})
    (good,) = start_fakes("good")
    gateway = start_gateway(gateway_config({"first": [bad.url], "second": [good.url]}))
    results = await send_many(gateway.url, 6)
    assert [status for status, _ in results] == [200] * 6
    assert good.stats()["models"] == ["second-upstream"] * 6  # renamed for the provider that served it
    assert metric(gateway, "switchyard_fallbacks_total", from_provider="first", to_provider="second") >= 1


async def test_client_errors_are_relayed_not_retried(start_fakes, start_gateway) -> None:
    a, b = start_fakes("a", "b")
    gateway = start_gateway(gateway_config({"p": [a.url, b.url]}))
    async with (
        aiohttp.ClientSession() as client,
        client.post(gateway.url + CHAT, json={**BODY, "fake": {"status": 422}}) as response,
    ):
        assert response.status == 422
        assert (await response.json())["error"]["message"].startswith("fake 422")
    assert a.stats()["num_requests"] + b.stats()["num_requests"] == 1


async def test_everything_failing_gives_502_listing_what_was_tried(start_fakes, start_gateway) -> None:
    bad1, bad2 = start_fakes("bad1", "bad2", behaviour={"status": 500})
    gateway = start_gateway(gateway_config({"p": [bad1.url], "q": [bad2.url]}))
    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=BODY) as response:
        assert response.status == 502
        error = (await response.json())["error"]
    assert error["type"] == "upstream_error"
    assert bad1.url in error["message"] and bad2.url in error["message"] and "HTTP 500" in error["message"]


async def test_retry_after_holds_the_endpoint_off_and_the_retry_goes_elsewhere(start_fakes, start_gateway) -> None:
    (limited,) = start_fakes("limited", behaviour={"status": 429, "retry_after": 3600})
    (good,) = start_fakes("good")
    gateway = start_gateway(gateway_config({"p": [limited.url, good.url]}, retries={"max_retry_after_s": 600.0}))
    # The retry goes to the other endpoint without waiting out the Retry-After (capped at 600 s here, far past
    # the client's 30 s), and the limited endpoint gets no new request while it is held off.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        for _ in range(6):
            async with client.post(gateway.url + CHAT, json=BODY) as response:
                assert response.status == 200
    assert (limited.stats()["num_requests"], good.stats()["num_requests"]) == (1, 6)


@pytest.mark.parametrize("retry_after", ["inf", "1e400", "nan", "-5"])
async def test_a_retry_after_that_is_no_finite_wait_is_ignored(start_fakes, start_gateway, retry_after: str) -> None:
    """float() reads "inf" and "1e400" as infinity: the 429 the client got then rounded it for its own
    Retry-After and raised (a 500). Such a header is no wait at all; "-5" is no wait either."""
    (limited,) = start_fakes("limited", behaviour={"status": 429, "retry_after": retry_after})
    gateway = start_gateway(gateway_config({"p": [limited.url]}))
    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=BODY) as response:
        assert response.status == 429, await response.text()
        assert (await response.json())["error"]["code"] == "upstream_rate_limited"
        assert int(response.headers.get("Retry-After", "1")) >= 1


async def test_circuit_breaker_opens_half_opens_and_closes(start_fakes, start_gateway) -> None:
    (bad,) = start_fakes("bad", behaviour={"status": 500})
    (good,) = start_fakes("good")
    gateway = start_gateway(gateway_config({"p": [bad.url, good.url]},
                                           breaker={"failure_threshold": 2, "cooldown_s": 5.0}))
    results = await send_many(gateway.url, 10, concurrency=1)   # within the cool-down, on a loaded machine too
    assert [s for s, _ in results] == [200] * 10
    assert bad.stats()["num_requests"] == 2  # opened after 2 consecutive failures, then skipped
    assert metric(gateway, "switchyard_circuit_state", endpoint=bad.url) == 2
    bad.control(behaviour={})  # the endpoint recovers
    await await_until(lambda: metric(gateway, "switchyard_circuit_state", endpoint=bad.url) == 1,
                      "the circuit to half-open after the cool-down")
    results = await send_many(gateway.url, 4, concurrency=1)
    assert [s for s, _ in results] == [200] * 4
    assert bad.stats()["num_requests"] >= 3  # the probe went through ...
    assert metric(gateway, "switchyard_circuit_state", endpoint=bad.url) == 0  # ... and closed it


async def test_never_all_endpoints_of_a_provider_are_ejected(start_fakes, start_gateway) -> None:
    bad1, bad2 = start_fakes("bad1", "bad2", behaviour={"status": 500})
    gateway = start_gateway(gateway_config({"p": [bad1.url, bad2.url]},
                                           breaker={"failure_threshold": 1, "cooldown_s": 60}))
    await send_many(gateway.url, 3, concurrency=1)
    hits = bad1.stats()["num_requests"] + bad2.stats()["num_requests"]
    bad2.control(behaviour={})
    bad1.control(behaviour={})
    results = await send_many(gateway.url, 2, concurrency=1)
    # Both circuits are open, yet the least-recently-failed endpoint stays eligible and serves.
    assert [s for s, _ in results] == [200, 200]
    assert bad1.stats()["num_requests"] + bad2.stats()["num_requests"] == hits + 2
