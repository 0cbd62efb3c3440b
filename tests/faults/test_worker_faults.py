"""A real worker (bundled SmolLM2) hung or killed before its first byte while the gateway routes to it and to a
healthy one (issue 11 §2, scenario 4). Hung (SIGSTOP): requests sent to it are retried on the other worker
once the first-byte deadline passes, and served whole; after SIGCONT it serves again. Killed (SIGKILL) with
requests at it: they are retried on the other worker and served whole. A killed worker mid-stream is
tests/backends/server/test_failover_workers.py's subject.

Session affinity routes each request: a session key's ring home is computed here as the policy computes it,
so a test sends requests to the worker it means. Who served is read from the healthy worker's own request
counter, or, for the worker that was hung, from the gateway's: a first choice served with no retry.
"""
from __future__ import annotations

import asyncio
import itertools
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from policies.session_affinity import HashRing, SessionAffinityConfig, ring_hash
from tests.faults.client import DONE, Reply, assert_gateway_serves, content, post
from tests.gateway.conftest import metric
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import await_until
from tests.support.worker_proc import WorkerProcess

pytestmark = pytest.mark.slow

FIRST_BYTE_S = 10.0  # a hung worker is given up on after this (a healthy one's first byte takes well under)
MAX_TOKENS = 8
COMPLETIONS = "/v1/completions"


class Pair:
    """Workers `a` and `b` behind one gateway (session affinity over both)."""

    def __init__(self, workdir: Path) -> None:
        self.a, self.b = (WorkerProcess(["--threads", "1", "--max-num-seqs", "4"], log_dir=workdir, wait=False)
                          for _ in range(2))
        for worker in (self.a, self.b):
            worker.wait_healthy()
        urls = [self.a.url, self.b.url]
        config = {
            # No load bound: a session goes to its ring home however many requests are there already.
            "models": {"smollm2": {"providers": ["w"], "policy": {"name": "session_affinity",
                                                                 "options": {"load_factor": 1000.0}}}},
            "providers": {"w": {"kind": "openai", "endpoints": urls,
                                "timeouts": {"connect_s": 5.0, "first_byte_s": FIRST_BYTE_S, "total_s": 120.0}}},
            # A hung worker's health poll outlasts the first-byte deadline: requests meet the hang itself.
            "pollers": {"health_interval_s": 0.2, "timeout_s": 60.0},
            "retries": {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "budget_min_retries": 100},
            "keepalive_s": 1.0,
        }
        self.gateway = GatewayProcess(config, workdir)
        self._ring = HashRing(urls, SessionAffinityConfig().num_virtual_nodes)
        self._keys = (f"session-{i}" for i in itertools.count())

    def session_at(self, worker: WorkerProcess) -> str:
        """A new session key whose ring home is `worker`."""
        accept = dict.fromkeys([self.a.url, self.b.url])
        return next(key for key in self._keys if self._ring.first(ring_hash(key), accept) == worker.url)

    async def complete(self, worker: WorkerProcess, stream: bool) -> Reply:
        """One request in a new session homed at `worker`."""
        body: dict[str, Any] = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                                "ignore_eos": True, "temperature": 0.0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return await post(self.gateway.url, body, path=COMPLETIONS,
                          headers={"x-session-affinity": self.session_at(worker)})

    def stop(self) -> None:
        self.gateway.stop()
        for worker in (self.a, self.b):
            worker.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    workers = Pair(tmp_path_factory.mktemp("worker-faults"))
    try:
        yield workers
    finally:
        workers.stop()


def num_answered(worker: WorkerProcess) -> int:
    """Completions the worker answered with 200 (its own counter)."""
    with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "switchyard_requests_total" and s.labels.get("route") == COMPLETIONS
                   and s.labels.get("status") == "200"))


def is_idle(worker: WorkerProcess) -> bool:
    with urllib.request.urlopen(worker.url + "/load", timeout=10) as response:
        load = orjson.loads(response.read())
    return load["num_running"] == 0 and load["num_waiting"] == 0


async def await_answered(worker: WorkerProcess, num_requests: int) -> None:
    """Until the worker's counter reaches `num_requests`: it counts a stream once its handler has returned,
    which may be just after the client got the stream's end."""
    await await_until(lambda: num_answered(worker) == num_requests, f"{worker.url} to have answered {num_requests}")


def assert_whole(reply: Reply, stream: bool) -> None:
    """MAX_TOKENS tokens to the end: a 200, the usage's count, and for a stream [DONE] and no error event."""
    assert reply.status == 200, reply.body[:2000]
    if not stream:
        payload = reply.json()
        assert payload["choices"][0]["finish_reason"] == "length", payload
        assert payload["usage"]["completion_tokens"] == MAX_TOKENS and payload["choices"][0]["text"], payload
        return
    events = [e for e in reply.events if e != b": keepalive"]
    assert events[-1] == DONE and not any(e.startswith(b'data: {"error"') for e in events), reply.body[:2000]
    assert "".join(text for e in events if (text := content(e))), events
    assert reply.payloads()[-1]["usage"]["completion_tokens"] == MAX_TOKENS


async def test_hung_worker_is_passed_over_then_serves_again(pair: Pair) -> None:
    answered_b = num_answered(pair.b)
    timeouts = metric(pair.gateway, "switchyard_upstream_errors_total", cause="timeout")
    pair.a.send_signal(signal.SIGSTOP)
    try:
        kinds = [(pair.a, False), (pair.a, False), (pair.a, True), (pair.b, False)]
        replies = await asyncio.gather(*(pair.complete(worker, stream) for worker, stream in kinds))
        for reply, (_, stream) in zip(replies, kinds, strict=True):
            assert_whole(reply, stream)
        # The stream waited for the hung worker with keepalives, then got its answer from the other one.
        assert replies[2].events[0] == b": keepalive"
        await await_answered(pair.b, answered_b + len(kinds))   # each ran there once
        assert metric(pair.gateway, "switchyard_upstream_errors_total", cause="timeout") == timeouts + 3
    finally:
        pair.a.send_signal(signal.SIGCONT)
    # It first runs what it had taken while hung (legs the gateway has given up on), then it is idle.
    await await_until(lambda: is_idle(pair.a), "the worker that was hung to run what it had taken")
    # Served by the worker that was hung: its sessions' first choice, with no retry and no failure.
    retries, errors = metric(pair.gateway, "switchyard_retries_total"), \
        metric(pair.gateway, "switchyard_upstream_errors_total")
    for stream in (False, True):
        assert_whole(await pair.complete(pair.a, stream), stream)
    assert metric(pair.gateway, "switchyard_retries_total") == retries
    assert metric(pair.gateway, "switchyard_upstream_errors_total") == errors
    await assert_gateway_serves(pair.gateway)


async def test_worker_killed_before_its_first_byte_is_replaced_by_the_other(pair: Pair) -> None:
    answered_b = num_answered(pair.b)
    pair.a.send_signal(signal.SIGSTOP)   # it takes the requests (the kernel queues them) and sends nothing
    kinds = [False, True]
    tasks = [asyncio.create_task(pair.complete(pair.a, stream)) for stream in kinds]
    await await_until(lambda: metric(pair.gateway, "switchyard_inflight_requests", endpoint=pair.a.url) == 2,
                      "both requests to be sent to the stopped worker")
    pair.a.send_signal(signal.SIGKILL)
    for reply, stream in zip(await asyncio.gather(*tasks), kinds, strict=True):
        assert_whole(reply, stream)
    await await_answered(pair.b, answered_b + 2)
    # Later requests for the dead worker's sessions are served too.
    assert_whole(await pair.complete(pair.a, False), False)
    await await_answered(pair.b, answered_b + 3)
    assert not pair.a.alive and pair.b.alive
    await assert_gateway_serves(pair.gateway)
