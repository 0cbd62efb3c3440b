"""Disaggregated prefill/decode orchestrated by the gateway (docs/disaggregation.md), against fake prefill
and decode processes that follow the protocol: the fake decode refuses a leg without the prefill's
kv_transfer_params and claims the held transfer from the fake prefill over HTTP.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.gateway.conftest import metric
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import await_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}
LOAD_IDLE = {"num_running": 0, "num_waiting": 0, "num_prefill_tokens_pending": 0, "num_decode_tokens_pending": 0,
             "num_free_blocks": 100, "num_total_blocks": 100, "num_cached_blocks": 0, "block_size": 16}
BUSY = {**LOAD_IDLE, "num_prefill_tokens_pending": 100000, "num_decode_tokens_pending": 100000}


def pd_config(prefill: list[FakeUpstream], decode: list[FakeUpstream], both: list[FakeUpstream] | None = None,
              health_interval_s: float = 0.2, max_attempts: int = 4, policy: str = "least_tokens") -> dict[str, Any]:
    timeouts = {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 30.0}
    providers: dict[str, Any] = {"pd": {
        "kind": "switchyard-pd", "prefill_endpoints": [f.url for f in prefill], "endpoints": [f.url for f in decode],
        "upstream_model": "pd-upstream", "offers_load": True, "timeouts": timeouts}}
    if both:
        providers["both"] = {"kind": "openai", "endpoints": [f.url for f in both], "timeouts": timeouts}
    return {
        "models": {"m": {"providers": list(providers), "policy": {"name": policy}}},
        "providers": providers,
        "pollers": {"health_interval_s": health_interval_s, "load_interval_s": 0.1, "kv_events_interval_s": 0.2},
        "retries": {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "backoff_jitter_s": 0.01,
                    "max_attempts": max_attempts},
        "breaker": {"failure_threshold": 100},
    }


def start_fakes(role: str, *names: str, behaviour: dict[str, Any] | None = None) -> list[FakeUpstream]:
    fakes = [FakeUpstream(name, behaviour, wait=False, role=role) for name in names]
    for fake in fakes:
        fake.wait_ready()
        fake.control(load_report=LOAD_IDLE)
    return fakes


class Pd:
    """One gateway over a prefill pool and a decode pool (and, optionally, a unified fallback)."""

    def __init__(self, workdir: Path, prefill: list[str], decode: list[str], both: tuple[str, ...] = (),
                 **config: Any) -> None:
        self.prefill = start_fakes("prefill", *prefill)
        self.decode = start_fakes("decode", *decode)
        self.both = start_fakes("both", *both)
        try:
            self.gateway = GatewayProcess(pd_config(self.prefill, self.decode, self.both, **config), workdir)
        except BaseException:
            self._stop_fakes()  # else a gateway that fails to start leaves the fakes running
            raise

    def stop(self) -> None:
        self.gateway.stop()
        self._stop_fakes()

    def _stop_fakes(self) -> None:
        for fake in self.prefill + self.decode + self.both:
            fake.stop()


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pd]:
    pair = Pd(tmp_path_factory.mktemp("pd"), ["p1"], ["d1"])
    yield pair
    pair.stop()


async def post(url: str, body: dict[str, Any], path: str = CHAT,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as client, client.post(url + path, json=body, headers=headers) as response:
        return response.status, orjson.loads(await response.read())


async def stream(url: str, body: dict[str, Any], path: str = CHAT,
                 on_first: Callable[[], None] | None = None) -> list[bytes]:
    """The SSE data events; `on_first` runs as soon as the first one has arrived."""
    events: list[bytes] = []
    async with aiohttp.ClientSession() as client, client.post(url + path, json={**body, "stream": True}) as response:
        assert response.status == 200
        tail = b""
        async for chunk in response.content.iter_any():
            *done, tail = (tail + chunk).split(b"\n\n")
            events.extend(e[6:] for e in done if e.startswith(b"data: "))
            if events and on_first is not None:
                on_first()
                on_first = None
    return events


def stream_text(events: list[bytes]) -> str:
    text = ""
    for data in events:
        if data == b"[DONE]":
            continue
        for choice in orjson.loads(data).get("choices", []):
            text += choice.get("delta", {}).get("content") or choice.get("text") or ""
    return text


async def wait_idle(gateway: GatewayProcess, urls: list[str]) -> None:
    """Every lease of these endpoints is back to zero (the in-flight gauges). The deadline stays below the
    legs' 30 s total timeout, so a lease that only that timeout would end does not pass."""
    await await_until(lambda: all(metric(gateway, "switchyard_inflight_requests", endpoint=u) == 0
                                  and metric(gateway, "switchyard_inflight_tokens", endpoint=u) == 0 for u in urls),
                      "the leases to be released", timeout_s=10)


async def wait_load_report(gateway: GatewayProcess, url: str, report: dict[str, int]) -> None:
    """The load poller has fed `report` (as the fake's /load answers it) into the gateway's gauges."""
    num_tokens = report["num_prefill_tokens_pending"] + report["num_decode_tokens_pending"]
    await await_until(lambda: metric(gateway, "switchyard_inflight_tokens", endpoint=url) == num_tokens,
                      f"the load report of {url} to reach the gateway")


# --- the happy path (one gateway for the module) ---------------------------------------------------

async def test_stream_sends_the_first_token_before_the_decode_leg_answers(pd: Pd) -> None:
    # The decode leg is held until the client has the first token: a gateway that waited for the
    # decode leg before relaying the first token never gets an answer from it (it times out).
    body = {**BODY, "fake": {"decode": {"stall_gate": "first-token-out"}}}
    events = await stream(pd.gateway.url, body, on_first=lambda: pd.decode[0].release("first-token-out"))
    first = orjson.loads(events[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "first "}
    assert stream_text(events) == "first tok1 tok2 tok3 "
    assert events[-1] == b"[DONE]"
    ids = {orjson.loads(data)["id"] for data in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-xfer-p1-")  # one id: the prefill's, kept by the decode
    decode_body = pd.decode[0].stats()["last_body"]
    assert decode_body["max_tokens"] == 50 and decode_body["stream"] is True
    assert decode_body["model"] == "pd-upstream"
    assert decode_body["kv_transfer_params"]["remote_engine_id"] == "p1"
    assert pd.prefill[0].stats()["held"] == []  # the decode claimed the transfer


async def test_completions_stream_and_non_streaming_join_with_merged_usage(pd: Pd) -> None:
    events = await stream(pd.gateway.url, {"model": "m", "prompt": "hi", "max_tokens": 9}, COMPLETIONS)
    assert orjson.loads(events[0])["choices"][0]["text"] == "first "
    assert stream_text(events) == "first tok1 tok2 tok3 "
    status, answer = await post(pd.gateway.url, {**BODY, "fake": {"decode": {"chunks": 4}}})
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == "first tok1 tok2 tok3 tok4 "
    assert answer["id"].startswith("cmpl-xfer-p1-")
    # prompt and cached tokens from the prefill leg (the fake decode reports 7 cached), completion from decode
    assert answer["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                               "prompt_tokens_details": {"cached_tokens": 3}}
    status, answer = await post(pd.gateway.url, {"model": "m", "prompt": "hi"}, COMPLETIONS)
    assert answer["choices"][0]["text"] == "first tok1 tok2 tok3 "
    # a leg's latency is observed once its upstream body has ended, which may come after the client's answer
    for leg in ("prefill", "decode"):
        await await_until(lambda leg=leg: metric(pd.gateway, "switchyard_upstream_latency_seconds_count",
                                                 leg=leg) >= 3, f"three {leg} legs observed")


@pytest.mark.parametrize("fake", [{"prefill": {"finish": "stop"}}, None])
async def test_no_decode_leg_when_the_prefill_finished(pd: Pd, fake: dict[str, Any] | None) -> None:
    body = {**BODY, "fake": fake} if fake else {**BODY, "max_tokens": 1}
    decode_hits = pd.decode[0].stats()["num_requests"]
    held = pd.prefill[0].stats()["held"]
    status, answer = await post(pd.gateway.url, body)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "first "
    assert "kv_transfer_params" not in answer
    events = await stream(pd.gateway.url, {**body, "stream_options": {"include_usage": True}})
    assert stream_text(events) == "first " and events[-1] == b"[DONE]"
    assert orjson.loads(events[-2])["usage"]["completion_tokens"] == 1
    assert pd.decode[0].stats()["num_requests"] == decode_hits
    if not fake:   # max_tokens 1: a plain one-token request, nothing held for a decode leg that never comes
        assert "kv_transfer_params" not in pd.prefill[0].stats()["last_body"]
        assert pd.prefill[0].stats()["held"] == held


async def test_kv_transfer_failed_redoes_the_request_with_a_new_prefill(pd: Pd) -> None:
    transfers = pd.prefill[0].stats()["num_transfers"]
    pd.decode[0].control(behaviour={"status": 503, "code": "kv_transfer_failed"}, times=1)
    status, answer = await post(pd.gateway.url, BODY)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "first tok1 tok2 tok3 "
    assert pd.prefill[0].stats()["num_transfers"] == transfers + 2  # prefilled twice
    assert metric(pd.gateway, "switchyard_pd_redos_total", code="kv_transfer_failed") == 1


@pytest.mark.parametrize("code", ["kv_transfer_mismatch", "kv_transfer_failed"])
async def test_kv_that_does_not_arrive_after_the_first_token_is_recomputed_on_a_decode_worker(
        pd: Pd, code: str) -> None:
    """A stream already has the prefill's first token: it goes on from it on a decode worker, which serves it
    whole (the fake's plain answer, tok0...), not ended by an error event."""
    continued = metric(pd.gateway, "switchyard_stream_failovers_total", model="m", outcome="continued")
    pd.decode[0].control(behaviour={"status": 400 if code == "kv_transfer_mismatch" else 503, "code": code}, times=1)
    events = await stream(pd.gateway.url, BODY)
    assert stream_text(events) == "first tok0 tok1 tok2 " and events[-1] == b"[DONE]"
    assert all("error" not in orjson.loads(e) for e in events[:-1])
    assert metric(pd.gateway, "switchyard_stream_failovers_total", model="m", outcome="continued") == continued + 1
    await wait_idle(pd.gateway, [pd.prefill[0].url, pd.decode[0].url])


async def test_kv_of_other_weights_is_not_asked_for_again(pd: Pd) -> None:
    """A decode worker refuses KV of other weights (the pools hold two revisions, halfway through a rolling
    upgrade): a new prefill could meet the same difference, so the request runs whole on a decode worker."""
    transfers = pd.prefill[0].stats()["num_transfers"]
    redos = metric(pd.gateway, "switchyard_pd_redos_total", code="kv_transfer_mismatch")
    pd.decode[0].control(behaviour={"status": 400, "code": "kv_transfer_mismatch"}, times=1)
    status, answer = await post(pd.gateway.url, BODY)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 ", answer
    assert pd.prefill[0].stats()["num_transfers"] == transfers + 1   # prefilled once
    assert metric(pd.gateway, "switchyard_pd_redos_total", code="kv_transfer_mismatch") == redos + 1
    await wait_idle(pd.gateway, [pd.prefill[0].url, pd.decode[0].url])


async def test_leases_follow_each_pool_and_return_to_zero_on_cancel(pd: Pd) -> None:
    p_url, d_url = pd.prefill[0].url, pd.decode[0].url
    # The decode leg streams one token, then is held (never let go) until the client is cancelled.
    body = {**BODY, "max_tokens": 500, "fake": {"decode": {"chunks": 200, "chunk_gate": "lease-test"}}}
    task = asyncio.create_task(stream(pd.gateway.url, body))
    await await_until(lambda: pd.decode[0].num_waiting("lease-test") == 1, "the decode leg to be mid-stream")
    gw = pd.gateway
    # The decode lease is held, the prefill's released (it could not be by the end of the stream: there is none).
    await await_until(lambda: metric(gw, "switchyard_inflight_requests", endpoint=d_url) == 1
                      and metric(gw, "switchyard_inflight_requests", endpoint=p_url) == 0,
                      "only the decode lease to be held while the decode leg streams")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_idle(gw, [p_url, d_url])
    assert gw.alive


# --- failures (a gateway each) -----------------------------------------------------------------------

async def test_prefill_failure_is_retried_on_another_prefill_worker(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["bad", "good"], ["d1"])
    try:
        bad, good = pair.prefill
        bad.control(behaviour={"status": 500})
        good.control(load_report=BUSY)  # so the policy tries `bad` first, every time
        await wait_load_report(pair.gateway, good.url, BUSY)
        for request_stream in (False, True, False):
            if request_stream:
                assert stream_text(await stream(pair.gateway.url, BODY)) == "first tok1 tok2 tok3 "
            else:
                status, answer = await post(pair.gateway.url, BODY)
                assert status == 200 and answer["choices"][0]["message"]["content"] == "first tok1 tok2 tok3 "
        assert bad.stats()["num_requests"] == 3 and good.stats()["num_transfers"] == 3
        assert metric(pair.gateway, "switchyard_upstream_errors_total", provider="pd") == 3
        good.control(load_report=LOAD_IDLE)  # the gauges include what the worker reports
        await wait_idle(pair.gateway, [bad.url, good.url, pair.decode[0].url])
    finally:
        pair.stop()


async def test_decode_legs_go_to_workers_of_the_prefill_workers_weights(tmp_path: Path) -> None:
    """Halfway through a rolling upgrade (weights a -> b) the gateway pairs a prefill worker with the decode
    workers of its weights, as their /load reports say, over a less busy one that would refuse its KV; where no
    decode worker has its weights, with any."""
    pair = Pd(tmp_path, ["p1"], ["old", "new"])
    try:
        p1, (old, new) = pair.prefill[0], pair.decode

        async def report(fake: FakeUpstream, load: dict[str, Any], weights: str) -> None:
            fake.control(load_report={**load, "weights": weights})
            await wait_load_report(pair.gateway, fake.url, load)

        await report(old, BUSY, "a")
        await report(new, {**LOAD_IDLE, "num_decode_tokens_pending": 1}, "b")
        for step, (weights, served_by) in enumerate([("a", old), ("b", new), ("c", new)], start=1):
            await report(p1, {**LOAD_IDLE, "num_prefill_tokens_pending": step}, weights)
            before = {fake.url: fake.stats()["num_requests"] for fake in pair.decode}
            status, answer = await post(pair.gateway.url, BODY)
            assert status == 200 and answer["choices"][0]["message"]["content"] == "first tok1 tok2 tok3 "
            assert {fake.url: fake.stats()["num_requests"] - before[fake.url] for fake in pair.decode} == \
                {served_by.url: 1, ({old, new} - {served_by}).pop().url: 0}, weights
    finally:
        pair.stop()


async def test_a_decode_worker_that_refused_a_prefill_workers_kv_is_passed_over_for_its_next_legs(
        tmp_path: Path) -> None:
    """With no weights reported (workers from before the field, or a fleet whose loads are not polled yet), a
    decode worker that refused a prefill worker's KV once is passed over for its next decode legs, here for a
    busier one, instead of each request costing a refusal and a second computation of its prompt; once the two
    report the same weights (the decode worker restarted on the prefill worker's revision), it takes them again."""
    pair = Pd(tmp_path, ["p1"], ["near", "far"])
    try:
        p1, (near, far) = pair.prefill[0], pair.decode
        near.control(refuses_kv=True)
        far.control(load_report=BUSY)
        await wait_load_report(pair.gateway, far.url, BUSY)
        status, answer = await post(pair.gateway.url, BODY)
        assert status == 200 and answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 ", answer  # whole
        assert metric(pair.gateway, "switchyard_pd_redos_total", code="kv_transfer_mismatch") == 1

        async def served(expected: FakeUpstream) -> None:
            before = {fake.url: fake.stats()["num_requests"] for fake in pair.decode}
            transfers = p1.stats()["num_transfers"]
            status, answer = await post(pair.gateway.url, BODY)
            assert status == 200 and answer["choices"][0]["message"]["content"] == "first tok1 tok2 tok3 ", answer
            assert {fake.url: fake.stats()["num_requests"] - before[fake.url] for fake in pair.decode} == \
                {expected.url: 1, ({near, far} - {expected}).pop().url: 0}
            assert p1.stats()["num_transfers"] == transfers + 1

        for _ in range(3):
            await served(far)
        assert metric(pair.gateway, "switchyard_pd_redos_total", code="kv_transfer_mismatch") == 1
        near.control(refuses_kv=False, load_report={**LOAD_IDLE, "num_decode_tokens_pending": 1, "weights": "a"})
        p1.control(load_report={**LOAD_IDLE, "num_prefill_tokens_pending": 1, "weights": "a"})
        await wait_load_report(pair.gateway, near.url, {**LOAD_IDLE, "num_decode_tokens_pending": 1})
        await wait_load_report(pair.gateway, p1.url, {**LOAD_IDLE, "num_prefill_tokens_pending": 1})
        await served(near)
        far.control(load_report=LOAD_IDLE)
        near.control(load_report=LOAD_IDLE)
        p1.control(load_report=LOAD_IDLE)
        await wait_idle(pair.gateway, [p1.url, near.url, far.url])
    finally:
        pair.stop()


async def test_decode_failure_is_retried_on_another_decode_worker(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["p1"], ["bad", "good"])
    try:
        bad, good = pair.decode
        bad.control(behaviour={"status": 502})
        good.control(load_report=BUSY)
        await wait_load_report(pair.gateway, good.url, BUSY)
        events = await stream(pair.gateway.url, BODY)  # the first token is out before the decode fails
        assert stream_text(events) == "first tok1 tok2 tok3 " and events[-1] == b"[DONE]"
        status, answer = await post(pair.gateway.url, BODY)
        assert status == 200 and answer["choices"][0]["message"]["content"] == "first tok1 tok2 tok3 "
        assert bad.stats()["num_requests"] == 2 and good.stats()["num_requests"] == 2
        assert pair.prefill[0].stats()["num_transfers"] == 2  # the held blocks were reused, no new prefill
        good.control(load_report=LOAD_IDLE)
        await wait_idle(pair.gateway, [pair.prefill[0].url, bad.url, good.url])
    finally:
        pair.stop()


async def test_dead_decode_pool_falls_back_to_the_next_provider(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["p1"], ["d1"], ("unified",))
    try:
        pair.decode[0].kill()
        # Right away (the decode leg fails, or health already noticed): the unified provider answers.
        status, answer = await post(pair.gateway.url, BODY)
        assert status == 200 and answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "

        async def served_without_a_prefill_leg() -> bool:
            prefills = pair.prefill[0].stats()["num_requests"]
            status, answer = await post(pair.gateway.url, BODY)
            assert status == 200 and answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
            return pair.prefill[0].stats()["num_requests"] == prefills

        # Once health checks mark the decode pool down, no prefill leg is even sent ...
        await await_until(served_without_a_prefill_leg, "requests to be served without a prefill leg")
        prefills = pair.prefill[0].stats()["num_requests"]
        assert stream_text(await stream(pair.gateway.url, BODY)) == "tok0 tok1 tok2 "  # ... streams included
        assert pair.prefill[0].stats()["num_requests"] == prefills
        gw = pair.gateway
        assert metric(gw, "switchyard_pd_fallbacks_total", cause="decode_pool_unavailable") >= 1
        assert metric(gw, "switchyard_fallbacks_total", from_provider="pd", to_provider="both") >= 1
        await wait_idle(gw, [pair.prefill[0].url, pair.decode[0].url, pair.both[0].url])
    finally:
        pair.stop()


async def test_decode_pool_broken_after_the_first_token_ends_the_stream(tmp_path: Path) -> None:
    pair = Pd(tmp_path, ["p1"], ["d1"], ("unified",), health_interval_s=60.0)
    try:
        pair.decode[0].kill()  # health checks will not notice for a minute
        status, answer = await post(pair.gateway.url, BODY)  # nothing sent yet: the next provider serves it
        assert status == 200 and answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
        assert metric(pair.gateway, "switchyard_pd_fallbacks_total", cause="decode_pool_exhausted") == 1
        events = await stream(pair.gateway.url, BODY)  # the first token is out: an error event ends it
        assert stream_text(events[:-2]) == "first "
        assert orjson.loads(events[-2])["error"]["type"] == "upstream_error"
        assert events[-1] == b"[DONE]"
        assert pair.both[0].stats()["num_requests"] == 1
    finally:
        pair.stop()
