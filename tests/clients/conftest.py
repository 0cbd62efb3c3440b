"""One running system for every client test: a real redis-server, two real workers on the bundled model and
a gateway in front of them with session affinity. Each client sends `x-session-affinity`; `same_worker`
checks that the header reached routing: all of a session's requests land on one worker (the workers'
own sequence counters) and the gateway routed each by its session (its routing-decision counter).
"""
from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProc
from tests.support.wait import wait_until
from tests.support.worker_proc import WorkerProcess, supervised

API_KEY = "sk-clients-secret"
MODEL = "smollm2"
SESSION_HEADER = "x-session-affinity"


@dataclass(frozen=True)
class System:
    gateway_url: str                 # base URL, no /v1
    worker_urls: tuple[str, ...]     # the two workers behind it
    api_key: str = API_KEY

    @property
    def openai_base_url(self) -> str:
        return self.gateway_url + "/v1"

    def finished_sequences(self) -> list[float]:
        """Each worker's count of sequences ended (one per request it served)."""
        return [_sample(url + "/metrics", {}, "switchyard_finished_sequences_total", {}) for url in self.worker_urls]

    def session_decisions(self) -> float:
        """Routing decisions the gateway made by a request's session (affinity_new, _hit or _moved)."""
        return sum(_sample(self.gateway_url + "/metrics", {"Authorization": f"Bearer {self.api_key}"},
                           "switchyard_routing_decisions_total", {"model": MODEL, "reason": reason})
                   for reason in ("affinity_new", "affinity_hit", "affinity_moved"))


def _sample(url: str, headers: dict[str, str], name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


@contextmanager
def same_worker(system: System, num_requests: int) -> Iterator[None]:
    """The block sends `num_requests` requests of one new session: they must all land on one worker."""
    before, decisions_before = system.finished_sequences(), system.session_decisions()
    yield

    def served() -> list[float] | None:
        counts = [after - b for after, b in zip(system.finished_sequences(), before, strict=True)]
        return counts if sum(counts) >= num_requests else None

    counts = wait_until(served, f"the workers to finish {num_requests} sequences")
    assert sorted(counts) == [0, num_requests], f"a session's requests were split over workers: {counts}"
    assert system.session_decisions() - decisions_before == num_requests   # each routed by its session


@pytest.fixture(scope="package")
def system(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    workdir = tmp_path_factory.mktemp("clients")
    args = ["--model", MODEL, "--served-model-name", MODEL, "--max-num-seqs", "8"]
    workers = [WorkerProcess(args, log_dir=workdir, wait=False) for _ in range(2)]   # start both at once
    try:
        with RedisProc() as redis, supervised(workers[0]) as first, supervised(workers[1]) as second:
            config = {
                "api_keys": [{"key_id": "clients", "key": API_KEY, "admin": True}],
                "redis_url": redis.url,
                "models": {MODEL: {"tokenizer": str(smollm2_dir), "providers": ["local"],
                                   # a load bound this loose never moves a session: where a request
                                   # lands shows the header alone, even for concurrent requests
                                   "policy": {"name": "session_affinity", "options": {"load_factor": 100.0}}}},
                "providers": {"local": {"kind": "openai", "endpoints": [first, second],
                                        "offers_load": True, "offers_kv_events": True}},
            }
            gateway = GatewayProcess(config, workdir)
            try:
                yield System(gateway.url, (first, second))
            finally:
                gateway.stop()
    finally:
        for worker in workers:
            worker.stop()
