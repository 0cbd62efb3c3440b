"""End to end: our workers' KV events reach the gateway's prefix index and steer routing.

Two real worker processes on the bundled model behind the real gateway (`offers_kv_events`, the
prefix_aware policy). A chat with a long system prompt lands on one worker; the gateway's index (its
/status.json) must then hold exactly that worker's cached blocks, as the worker's own /load counts them,
and a second chat sharing the prefix, with no session header, must go to the same worker and be
answered partly from its prefix cache. The gateway reading the worker's `/kv_events` with other field
names than the worker writes left the index empty and routing blind; this test fails that way.
"""
from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import wait_until
from tests.support.worker_proc import WorkerProcess, supervised

pytestmark = pytest.mark.slow

MODEL = "smollm2"
BLOCK_SIZE = 16  # the workers' default block size; the gateway's model block_size defaults to it too
SYSTEM = "You are a concise assistant for a railway company. Answer in one short sentence. " * 8


@dataclass(frozen=True)
class System:
    gateway: GatewayProcess
    workers: tuple[str, str]   # base URLs


@pytest.fixture(scope="module")
def system(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    workdir = tmp_path_factory.mktemp("kv_events")
    args = ["--model", MODEL, "--served-model-name", MODEL, "--max-num-seqs", "4"]
    starting = [WorkerProcess(args, log_dir=workdir, wait=False) for _ in range(2)]  # both load at once
    with contextlib.ExitStack() as stack:
        urls = tuple(stack.enter_context(supervised(worker)) for worker in starting)
        config = {
            "models": {MODEL: {"tokenizer": str(smollm2_dir), "providers": ["local"],
                               "policy": {"name": "prefix_aware"}}},
            "providers": {"local": {"kind": "openai", "endpoints": list(urls),
                                    "offers_load": True, "offers_kv_events": True}},
            "pollers": {"health_interval_s": 0.2, "load_interval_s": 0.1, "kv_events_interval_s": 0.1},
            "log_level": "WARNING",
        }
        gateway = GatewayProcess(config, workdir)
        try:
            yield System(gateway, (urls[0], urls[1]))
        finally:
            gateway.stop()


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return orjson.loads(response.read())


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def _indexed_blocks(system: System) -> dict[str, int]:
    """The gateway's prefix index, per endpoint (its /status.json)."""
    return {e["id"]: e["num_indexed_blocks"] for e in _json(system.gateway.url + "/status.json")["endpoints"]}


def _cached_blocks(worker: str) -> int:
    """Blocks the worker's prefix cache holds, by its own count (its /load)."""
    return _json(worker + "/load")["num_cached_blocks"]


def _chats_served(worker: str) -> int:
    return int(sum(value for name, labels, value in _samples(worker)
                   if name == "switchyard_requests_total" and labels["route"] == "/v1/chat/completions"))


def _gateway_metric(system: System, name: str, **labels: str) -> float:
    return sum(value for n, ls, value in _samples(system.gateway.url)
               if n == name and labels.items() <= ls.items())


def test_worker_kv_events_fill_the_index_and_route_a_shared_prefix_home(system: System) -> None:
    client = openai.OpenAI(base_url=system.gateway.url + "/v1", api_key="unused", max_retries=0)

    def chat(question: str) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=2,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

    first = chat("Which platform for Leeds?")
    num_prompt_blocks = first.usage.prompt_tokens // BLOCK_SIZE
    assert num_prompt_blocks >= 6, first.usage  # several full blocks, or the test proves little
    served = wait_until(lambda: [w for w in system.workers if _chats_served(w)], "the first chat to be counted")
    assert len(served) == 1, served
    home, = served
    other, = (w for w in system.workers if w != home)
    assert _json(home + "/load")["block_size"] == BLOCK_SIZE

    # The index learns the home worker's blocks from its events: the same number the worker reports
    # cached (its prompt's full blocks at least), and nothing for the worker that served nothing.
    def index_matches_home() -> bool:
        indexed = _indexed_blocks(system)
        return indexed[home] == _cached_blocks(home) >= num_prompt_blocks and indexed[other] == 0

    try:
        wait_until(index_matches_home, "the gateway's index to hold the home worker's cached blocks", timeout_s=20)
    except AssertionError as exc:
        pytest.fail(f"{exc}: index {_indexed_blocks(system)}, cached at {home}: {_cached_blocks(home)}; "
                    f"gateway log:\n{system.gateway.log()[-3000:]}")
    assert _cached_blocks(other) == 0
    assert _gateway_metric(system, "switchyard_poll_failures_total", poller="kv_events") == 0

    # The same prefix, another question, no x-session-affinity: routed by the index to the home worker,
    # which answers the shared blocks from its prefix cache.
    second = chat("Is the 9:15 to York on time?")
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= BLOCK_SIZE * 4, second.usage  # SYSTEM's blocks
    wait_until(lambda: _chats_served(home) + _chats_served(other) == 2, "the second chat to be counted")
    assert (_chats_served(home), _chats_served(other)) == (2, 0)
    assert _gateway_metric(system, "switchyard_routing_decisions_total", model=MODEL, reason="prefix_hit") == 1
