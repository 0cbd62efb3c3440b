"""An upstream that answers 500, 502, 503 or 429, with and without Retry-After (issue 11 §2, scenario 1).

Beside a healthy endpoint the client gets the whole answer; alone, it gets an OpenAI-style 502
`upstream_failed` naming what failed (a 429 `upstream_rate_limited` when every upstream tried answered 429),
with the upstream's Retry-After relayed (dispatch.py `_final_error`).
Each request has its own x-request-id and the fakes log the ids they received: the failing endpoint saw
each request once, the healthy one at most once, and with `max_attempts: 1` nothing is retried at all.
tests/gateway/test_fallback.py covers the breaker, the Retry-After hold-off and provider fallback; this adds
the status matrix and the per-request accounting.
"""
from __future__ import annotations

from typing import Any

import pytest

from tests.faults.client import (
    assert_gateway_serves,
    assert_openai_error,
    assert_whole_answer,
    chat,
    new_request_id,
    post,
)
from tests.faults.conftest import Processes, num_seen
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess

STATUSES = [500, 502, 503, 429]
RETRY_AFTER_S = 7
WORDS = "tok0 tok1 tok2 "


def _config(bad: FakeUpstream, good: FakeUpstream, max_attempts: int) -> dict[str, Any]:
    # No health polls and a breaker that never opens: every request meets the failing endpoint first
    # (round robin over [bad, good] advances twice per retried request), so each case is the same one.
    timeouts = {"connect_s": 5.0, "first_byte_s": 30.0, "total_s": 60.0}
    providers = {name: {"kind": "openai", "endpoints": urls, "timeouts": timeouts, "health_path": None}
                 for name, urls in {"pair": [bad.url, good.url], "solo": [bad.url], "spare": [good.url]}.items()}
    models = {name: {"providers": chain, "policy": {"name": "round_robin"}}
              for name, chain in {"pair": ["pair"], "solo": ["solo"], "chain": ["solo", "spare"]}.items()}
    return {"models": models, "providers": providers, "keepalive_s": 60.0, "breaker": {"failure_threshold": 1000},
            # holding an endpoint off after its Retry-After is test_fallback's subject (0: never held, so every
            # case meets the failing endpoint); budget: the whole matrix retries in one window
            "retries": {"max_attempts": max_attempts, "backoff_initial_s": 0.01, "backoff_max_s": 0.05,
                        "backoff_jitter_s": 0.01, "max_retry_after_s": 0.0, "budget_min_retries": 1000}}


@pytest.fixture(scope="module")
def fleet(procs: Processes) -> tuple[FakeUpstream, FakeUpstream, GatewayProcess, GatewayProcess]:
    bad, good = procs.fakes("bad", "good")
    return bad, good, procs.gateway(_config(bad, good, 4)), procs.gateway(_config(bad, good, 1))


def _failing(status: int, retry_after: int | None) -> dict[str, Any]:
    return {"status": status, **({"retry_after": retry_after} if retry_after is not None else {})}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("retry_after", [None, RETRY_AFTER_S], ids=["plain", "retry-after"])
@pytest.mark.parametrize("status", STATUSES)
async def test_failing_endpoint_beside_a_healthy_one(fleet, status: int, retry_after: int | None,
                                                     stream: bool) -> None:
    bad, good, gateway, _ = fleet
    bad.control(behaviour=_failing(status, retry_after))
    request_id = new_request_id()
    reply = await post(gateway.url, chat("pair", stream), headers={"x-request-id": request_id})
    assert_whole_answer(reply, WORDS, stream)
    assert (num_seen(bad, request_id), num_seen(good, request_id)) == (1, 1)  # failed once, then served once
    await assert_gateway_serves(gateway)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("retry_after", [None, RETRY_AFTER_S], ids=["plain", "retry-after"])
@pytest.mark.parametrize("status", STATUSES)
async def test_failing_endpoint_alone(fleet, status: int, retry_after: int | None, stream: bool) -> None:
    bad, good, gateway, _ = fleet
    bad.control(behaviour=_failing(status, retry_after))
    request_id = new_request_id()
    reply = await post(gateway.url, chat("solo", stream), headers={"x-request-id": request_id})
    # A 5xx becomes the gateway's own 502; a 429 stays a 429 (every upstream tried is rate limiting: back off).
    if status == 429:
        error = assert_openai_error(reply, 429, "upstream_rate_limited")
        assert error["type"] == "rate_limit_error"
    else:
        error = assert_openai_error(reply, 502, "upstream_failed")
        assert error["type"] == "upstream_error"
    assert f"{bad.url}: HTTP {status}: fake {status} from bad" in error["message"]
    assert reply.headers.get("Retry-After") == (None if retry_after is None else str(retry_after))
    assert (num_seen(bad, request_id), num_seen(good, request_id)) == (1, 0)
    await assert_gateway_serves(gateway)


async def test_no_retry_beyond_max_attempts(fleet) -> None:
    bad, good, _, one_attempt = fleet
    bad.control(behaviour=_failing(503, None))
    request_id = new_request_id()
    # `chain` falls back from the failing provider to a healthy one, but one attempt allows no second leg.
    reply = await post(one_attempt.url, chat("chain", False), headers={"x-request-id": request_id})
    error = assert_openai_error(reply, 502, "upstream_failed")
    assert "HTTP 503" in error["message"] and "Retry-After" not in reply.headers
    assert (num_seen(bad, request_id), num_seen(good, request_id)) == (1, 0)
    bad.control(behaviour={})
    reply = await post(one_attempt.url, chat("chain", False))
    assert_whole_answer(reply, WORDS, False)
    await assert_gateway_serves(one_attempt)
