"""The live status pages in a real browser: Debian's headless Chromium loads /status of a real gateway (API keys,
Redis) and of a real worker on the bundled model, after real requests; the numbers the page rendered must be
the ones /metrics shows at that moment (quantities that hold still while the system is idle).

Each page is also saved as a PNG under $SWITCHYARD_ARTIFACTS (default tests/artifacts/) for a person to look at.
"""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_proc import GatewayProcess
from tests.support.redis_proc import RedisProc
from tests.support.wait import wait_until
from tests.support.worker_proc import worker_process

REPO = Path(__file__).resolve().parent.parent
ADMIN_KEY = "sk-status-admin"
USER_KEY = "sk-status-user"
MODEL = "smollm2"
# Virtual time the page runs for before Chromium dumps it: a few one-second polls, so the rates have points.
BUDGET_MS = 4000


@dataclass(frozen=True)
class System:
    gateway: str      # base URL
    worker: str       # base URL


@pytest.fixture(scope="module")
def system(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    workdir = tmp_path_factory.mktemp("status")
    with RedisProc() as redis, worker_process(["--model", "smollm2", "--served-model-name", MODEL,
                                               "--max-num-seqs", "8"], log_dir=workdir) as worker_url:
        config = {
            "redis_url": redis.url,
            "api_keys": [{"key_id": "ops", "key": ADMIN_KEY, "admin": True},
                         {"key_id": "team", "key": USER_KEY}],
            "models": {MODEL: {"tokenizer": str(smollm2_dir), "providers": ["local"],
                               "policy": {"name": "session_affinity"}}},
            "providers": {"local": {"kind": "openai", "endpoints": [worker_url],
                                    "offers_load": True, "offers_kv_events": True}},
            "response_cache": {"ttl_s": 600},
        }
        gateway = GatewayProcess(config, workdir)
        try:
            _send_requests(gateway.url)
            system = System(gateway.url, worker_url)
            wait_until(lambda: _idle(system), "the gateway and the worker to be idle")
            yield system
        finally:
            gateway.stop()


def _send_requests(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=USER_KEY, max_retries=0)
    system = "You are a concise assistant for a railway company. " * 6   # a few full KV blocks, reused
    for i in range(5):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]
        headers = {"x-session-affinity": f"agent-{i % 2}"}
        if i % 2:
            chunks = list(client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, stream=True,
                                                         messages=messages, extra_headers=headers))
            assert chunks
        else:
            reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=messages,
                                                   extra_headers=headers)
            assert reply.usage.completion_tokens > 0
    # the first question again, whole: answered from the response cache once the first answer is kept
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Question 0?"}]
    wait_until(lambda: client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=8, temperature=0, messages=first).headers.get("x-switchyard-cache") == "hit",
        "a repeat answered from the response cache")


def _idle(system: System) -> bool:
    """Nothing in flight, and the gateway has polled the worker's /load since its last prompt."""
    gateway = _metrics(system.gateway + "/metrics", ADMIN_KEY)
    worker = _metrics(system.worker + "/metrics")
    status, body = _get(system.gateway + "/status.json", ADMIN_KEY)
    assert status == 200, body
    (endpoint,) = orjson.loads(body)["endpoints"]
    return (sum(gateway.get(("switchyard_inflight_requests", ()), {}).values()) == 0
            and worker[("switchyard_num_requests_running", ())][()] == 0
            and worker[("switchyard_num_requests_waiting", ())][()] == 0
            and endpoint["num_prompt_tokens"] == worker[("switchyard_prompt_tokens_total", ())][()])


# --- what /metrics says -------------------------------------------------------------------------------

Metrics = dict[tuple[str, tuple[str, ...]], dict[tuple[str, ...], float]]


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _metrics(url: str, key: str | None = None) -> Metrics:
    """{(sample name, label names): {label values: value}}"""
    status, body = _get(url, key)
    assert status == 200, body
    out: Metrics = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            names = tuple(sorted(sample.labels))
            out.setdefault((sample.name, names), {})[tuple(sample.labels[n] for n in names)] = sample.value
    return out


def _one(metrics: Metrics, name: str, **labels: str) -> float:
    names = tuple(sorted(labels))
    return metrics[(name, names)][tuple(labels[n] for n in names)]


def _sum(metrics: Metrics, name: str, **labels: str) -> float:
    return sum(value for (sample, names), series in metrics.items() if sample == name
               for values, value in series.items()
               if all(dict(zip(names, values, strict=True)).get(k) == v for k, v in labels.items()))


# --- what the browser rendered ------------------------------------------------------------------------

def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed (apt-get install -y chromium; make test does this)")
    return path


def _artifacts() -> Path:
    folder = Path(os.environ.get("SWITCHYARD_ARTIFACTS") or REPO / "tests" / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _browse(url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after BUDGET_MS of virtual time in headless Chromium (and a PNG of it when asked)."""
    args = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--window-size=1400,1000", f"--virtual-time-budget={BUDGET_MS}"]
    if screenshot is not None:
        subprocess.run([*args, f"--screenshot={screenshot}", url], check=True, capture_output=True, timeout=120)
        assert screenshot.stat().st_size > 10_000, "the screenshot is (nearly) empty"
    out = subprocess.run([*args, "--dump-dom", url], check=True, capture_output=True, timeout=120)
    return out.stdout.decode()


def _fields(dom: str) -> dict[str, str]:
    """{data-field name: the text it shows}; the page marks every number a test may check this way."""
    rendered = re.search(r'<body[^>]*data-rendered="(\d+)"', dom)
    assert rendered and int(rendered.group(1)) >= 2, f"the page did not render twice:\n{dom[:3000]}"
    return {html.unescape(name): html.unescape(text)
            for name, text in re.findall(r'data-field="([^"]*)"[^>]*>([^<]*)<', dom)}


def _int(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.mark.slow
def test_gateway_page_shows_what_metrics_shows(system: System, tmp_path: Path) -> None:
    before = _metrics(system.gateway + "/metrics", ADMIN_KEY)
    dom = _browse(f"{system.gateway}/status#key={ADMIN_KEY}", tmp_path / "profile",
                  screenshot=_artifacts() / "gateway-status.png")
    after = _metrics(system.gateway + "/metrics", ADMIN_KEY)
    fields = _fields(dom)

    requests = _sum(after, "switchyard_requests_total", model=MODEL)
    assert requests == _sum(before, "switchyard_requests_total", model=MODEL) >= 5   # idle: nothing moved
    assert _int(fields[f"model:{MODEL}:requests"]) == requests
    assert _int(fields[f"model:{MODEL}:errors"]) == requests - _sum(after, "switchyard_requests_total", model=MODEL,
                                                                      status="200")
    assert _int(fields[f"model:{MODEL}:ttft_count"]) == _one(after, "switchyard_ttft_seconds_count", model=MODEL)
    streams = _one(after, "switchyard_itl_seconds_count", model=MODEL)
    assert _int(fields[f"model:{MODEL}:itl_count"]) == streams >= 1     # the streamed request above
    assert _int(fields[f"model:{MODEL}:cache_hits"]) == _one(after, "switchyard_response_cache_total", model=MODEL,
                                                             result="hit") >= 1

    circuits = after[("switchyard_circuit_state", ("endpoint",))]
    assert _int(fields["endpoints.count"]) == len(circuits) == 1
    assert _int(fields["endpoints.healthy"]) == sum(1 for state in circuits.values() if state == 0)
    (endpoint,) = circuits
    assert fields[f"endpoint:{endpoint[0]}:circuit"] == "closed" and circuits[endpoint] == 0
    assert fields[f"endpoint:{endpoint[0]}:health"] == "healthy"
    assert _int(fields[f"endpoint:{endpoint[0]}:requests"]) == _one(after, "switchyard_inflight_requests",
                                                                    endpoint=endpoint[0]) == 0
    # The worker's prefix-cache hit rate, as its /load told the gateway (idle: the lifetime rate).
    worker = _metrics(system.worker + "/metrics")
    shown = fields[f"endpoint:{endpoint[0]}:prefix_hit"]
    hit_rate = _one(worker, "switchyard_prefix_cache_hit_rate")
    assert hit_rate > 0 and shown.endswith("%") and abs(float(shown[:-1]) - 100 * hit_rate) <= 0.05 + 1e-9
    for reason, name in (("affinity_new", "sessions.new"), ("affinity_hit", "sessions.hits")):
        assert _int(fields[name]) == _sum(after, "switchyard_routing_decisions_total", model=MODEL, reason=reason)
    assert _int(fields["sessions.new"]) == 2     # agent-0 and agent-1
    assert _int(fields["sessions.live"]) == 2    # both still within the session TTL, counted in Redis


@pytest.mark.slow
def test_worker_page_shows_what_metrics_shows(system: System, tmp_path: Path) -> None:
    dom = _browse(f"{system.worker}/status", tmp_path / "profile", screenshot=_artifacts() / "worker-status.png")
    metrics = _metrics(system.worker + "/metrics")
    fields = _fields(dom)

    for field, metric in (("kv.total", "kv_blocks_total"), ("kv.used", "kv_blocks_used"),
                          ("kv.free", "kv_blocks_free"), ("kv.cached", "kv_blocks_cached"),
                          ("load.num_running", "num_requests_running"), ("load.num_waiting", "num_requests_waiting"),
                          ("stats.prompt_tokens", "prompt_tokens_total"),
                          ("stats.cached_prompt_tokens", "prompt_cached_tokens_total"),
                          ("stats.generation_tokens", "generation_tokens_total"),
                          ("stats.finished", "finished_sequences_total"), ("stats.preemptions", "preemptions_total"),
                          ("latency.ttft.count", "time_to_first_token_seconds_count"),
                          ("latency.itl.count", "inter_token_latency_seconds_count")):
        assert _int(fields[field]) == _one(metrics, f"switchyard_{metric}"), field
    assert _int(fields["kv.total"]) > 0 and _int(fields["kv.cached"]) > 0     # the shared system prompt's blocks
    assert _int(fields["stats.cached_prompt_tokens"]) > 0
    hit_rate = _one(metrics, "switchyard_prefix_cache_hit_rate")
    shown = fields["stats.prefix_hit_rate"]      # one decimal: JS rounds ties up, Python to even
    assert shown.endswith("%") and abs(float(shown[:-1]) - 100 * hit_rate) <= 0.05 + 1e-9
    chat = _one(metrics, "switchyard_requests_total", route="/v1/chat/completions", status="200")
    assert _int(fields["requests:/v1/chat/completions:200"]) == chat == 5


@pytest.mark.slow
def test_status_data_needs_the_admin_key(system: System, tmp_path: Path) -> None:
    status, page = _get(system.gateway + "/status")
    assert status == 200 and b"switchyard" in page           # the HTML holds no data: no key needed
    assert _get(system.gateway + "/status.json")[0] == 401
    status, body = _get(system.gateway + "/status.json", USER_KEY)
    assert status == 403 and orjson.loads(body)["error"]["type"]
    status, body = _get(system.gateway + "/status.json", ADMIN_KEY)
    assert status == 200 and orjson.loads(body)["kind"] == "gateway"
    # In the browser, without a key, the page asks for one instead of showing numbers.
    dom = _browse(f"{system.gateway}/status", tmp_path / "profile")
    assert 'id="state" class="pill down">key needed<' in dom and 'data-rendered="0"' in dom
    assert '<section class="kpis" id="kpis"></section>' in dom       # nothing rendered


INF = float("inf")


@pytest.mark.parametrize(("q", "buckets", "want"), [
    (0.5, [(1.0, 0), (INF, 0)], None),                          # no samples
    (0.5, [(1.0, 10), (2.0, 10), (INF, 10)], 0.5),              # all in the first bucket, interpolated from 0
    (0.5, [(1.0, 0), (2.0, 10), (INF, 10)], 1.5),
    (0.9, [(0.1, 5), (0.2, 10), (INF, 10)], 0.18),
    (0.99, [(1.0, 1), (2.0, 1), (INF, 10)], 2.0),                # past the last finite bucket: its bound
])
def test_both_pages_compute_quantiles_as_promql(q: float, buckets: list[tuple[float, float]],
                                                want: float | None) -> None:
    from backends.server.status import quantile as worker_quantile
    from gateway.api.status import quantile as gateway_quantile

    for quantile in (gateway_quantile, worker_quantile):
        got = quantile(q, buckets)
        assert got == want if want is None else got == pytest.approx(want)
