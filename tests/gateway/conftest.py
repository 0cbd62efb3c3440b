"""Fixtures for the gateway's integration tests: real redis-server, fake upstream and gateway processes."""
from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_upstream import FakeUpstream, free_port
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import wait_until


class RedisServer:
    """A throwaway redis-server on a free port; `kill()` and `start()` simulate an outage."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self._binary = binary
        self._workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self._workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers_ping, f"redis-server on port {self.port} to answer PING", timeout_s=10)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def start_fakes() -> Iterator[Callable[..., list[FakeUpstream]]]:
    started: list[FakeUpstream] = []

    def start(*names: str, behaviour: dict[str, Any] | None = None, role: str = "both") -> list[FakeUpstream]:
        fakes = [FakeUpstream(name, behaviour, wait=False, role=role) for name in names]
        started.extend(fakes)
        for fake in fakes:
            fake.wait_ready()
        return fakes

    yield start
    for fake in started:
        fake.stop()


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(config: dict[str, Any], **kwargs: Any) -> GatewayProcess:
        gateway = GatewayProcess(config, tmp_path, **kwargs)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def gateway_config(providers: dict[str, list[str]], *, policy: str = "round_robin",
                   chain: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A config with one model `m` over `providers` (name -> endpoint URLs), fast pollers and retries."""
    config: dict[str, Any] = {
        "models": {"m": {"providers": chain or list(providers), "policy": {"name": policy}}},
        "providers": {name: {"kind": "openai", "endpoints": urls, "upstream_model": f"{name}-upstream",
                             "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 30.0}}
                      for name, urls in providers.items()},
        "pollers": {"health_interval_s": 0.2, "load_interval_s": 0.2, "kv_events_interval_s": 0.2},
        "retries": {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "backoff_jitter_s": 0.01},
        "log_level": "WARNING",
    }
    config.update(extra)
    return config


def scrape(gateway: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gateway's /metrics as {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in scrape(gateway).items() if n == name and wanted <= set(ls))
