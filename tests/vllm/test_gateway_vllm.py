"""The gateway in front of two real vLLM servers: plain routing, session affinity, prefix-aware routing
from vLLM's own KV events (ZMQ), and vLLM's /metrics read as load. Which engine served a request is
read off the engines' own `vllm:request_success_total` (the tests send one request at a time)."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from backends.worker.loader import resolve_model
from tests.gateway.conftest import metric
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import wait_until
from tests.vllm.conftest import MODEL, VllmServer

pytestmark = pytest.mark.vllm

Pair = tuple[VllmServer, VllmServer]


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(pair: Pair, policy: str, **provider: Any) -> GatewayProcess:
        config = {
            # the engines' own folder: the gateway renders the same chat template, so its block hashes
            # of a prompt are those it rebuilds from vLLM's events
            "models": {MODEL: {"providers": ["vllm"], "policy": {"name": policy},
                               "tokenizer": str(resolve_model(MODEL))}},
            "providers": {"vllm": {"kind": "openai", "endpoints": [s.url for s in pair],
                                   "timeouts": {"connect_s": 2.0, "first_byte_s": 120.0, "total_s": 300.0},
                                   **provider}},
            "pollers": {"health_interval_s": 0.5, "load_interval_s": 0.2},
            "log_level": "INFO",
        }
        gateway = GatewayProcess(config, tmp_path)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def served_by(pair: Pair, send: Callable[[], object]) -> str:
    """Send one request and name the engine that finished it."""
    before = [s.num_finished() for s in pair]
    send()
    after = [s.num_finished() for s in pair]
    (name,) = [s.name for s, b, a in zip(pair, before, after, strict=True) if a == b + 1]
    return name


def chat(client: OpenAI, messages: list[dict], **kwargs: Any) -> Callable[[], object]:
    def send() -> object:
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **kwargs)
        assert response.usage is not None and response.usage.prompt_tokens > 0
        return response
    return send


def test_plain_routing_and_streaming(vllm_pair: Pair, start_gateway) -> None:
    gateway = start_gateway(vllm_pair, "round_robin")
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    homes = [served_by(vllm_pair, chat(client, [{"role": "user", "content": f"Count to {n}."}])) for n in range(4)]
    assert sorted(homes) == ["a", "a", "b", "b"] and homes[0] != homes[1]  # strict alternation
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                            max_tokens=8, stream=True)
    chunks = [c for c in stream]
    assert chunks and any(c.choices and c.choices[0].delta.content for c in chunks)


def test_session_affinity(vllm_pair: Pair, start_gateway) -> None:
    gateway = start_gateway(vllm_pair, "session_affinity")
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    for session in ("alice", "bob", "carol", "dave"):
        turns = [served_by(vllm_pair, chat(client, [{"role": "user", "content": f"Turn {t} of {session}."}],
                                           extra_headers={"x-session-affinity": session})) for t in range(3)]
        assert len(set(turns)) == 1, (session, turns)
    assert metric(gateway, "switchyard_routing_decisions_total", reason="affinity_hit") == 8


def long_system_prompt(i: int) -> dict:
    """About 300 tokens that no other prompt of the run starts with."""
    rules = " ".join(f"Rule {i}.{k}: be brief and exact." for k in range(40))
    return {"role": "system", "content": f"Agent {i}. {rules}"}


def test_prefix_aware_routing_from_vllm_kv_events(vllm_pair: Pair, start_gateway) -> None:
    a, b = vllm_pair
    gateway = start_gateway(vllm_pair, "prefix_aware", kv_event_sources={
        s.url: {"endpoint": s.kv_events_endpoint, "topic": s.topic} for s in vllm_pair})
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    fresh = itertools.count()

    def batches(engine: VllmServer) -> float:
        return metric(gateway, "switchyard_kv_event_batches_total", endpoint=engine.url)

    def follows_events(engine: VllmServer, events_flow: bool = True) -> bool:
        """Warm `engine` directly with a new system prompt, then send a new question under the same
        prompt through the gateway: True when it went there, chosen for its cached prefix. Once events
        flow, the question waits until the gateway has applied the warm-up's (vLLM publishes them after its
        step, and the gateway reads them in its own time)."""
        system = long_system_prompt(next(fresh))
        before = batches(engine)
        engine.chat([system, {"role": "user", "content": "First question?"}])
        if events_flow:
            wait_until(lambda: batches(engine) > before, f"vLLM {engine.name}'s KV events of the warm-up",
                       timeout_s=30, interval_s=0.05)
        hits = metric(gateway, "switchyard_routing_decisions_total", reason="prefix_hit")
        home = served_by(vllm_pair, chat(client, [system, {"role": "user", "content": "Second question?"}]))
        return home == engine.name and metric(gateway, "switchyard_routing_decisions_total",
                                               reason="prefix_hit") == hits + 1

    # Until each SUB socket has joined its publisher, events are dropped (PUB/SUB): wait for one hit each.
    for engine in vllm_pair:
        wait_until(lambda e=engine: follows_events(e, events_flow=False),
                   f"vLLM {engine.name}'s KV events to reach the gateway", timeout_s=120, interval_s=0.2)
    results = [(engine.name, follows_events(engine)) for _ in range(3) for engine in (a, b)]
    assert results == [("a", True), ("b", True)] * 3


def test_vllm_metrics_as_load(vllm_pair: Pair, start_gateway) -> None:
    a, _ = vllm_pair
    gateway = start_gateway(vllm_pair, "least_requests", offers_vllm_metrics=True)
    direct = OpenAI(base_url=a.url + "/v1", api_key="unused")
    stop = threading.Event()

    def keep_a_busy() -> None:  # another client's long generation on a, which the gateway cannot lease
        stream = direct.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a story."}],
                                                max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            if stop.is_set():
                stream.close()
                return

    busy = threading.Thread(target=keep_a_busy, daemon=True)
    busy.start()
    try:
        wait_until(lambda: metric(gateway, "switchyard_inflight_requests", endpoint=a.url) >= 1,
                   "vLLM a's running request to show in the gateway's load", timeout_s=60)
        client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
        homes = [served_by(vllm_pair, chat(client, [{"role": "user", "content": f"Quick {n}?"}])) for n in range(3)]
    finally:
        stop.set()
        busy.join(60)
    assert homes == ["b"] * 3
