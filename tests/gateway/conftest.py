"""Fixtures for the gateway's integration tests: real redis-server, fake upstream and gateway processes."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess


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
