"""The monitoring kit in docker/ against the real thing: every metric that a panel of the Grafana dashboard names
exists in the /metrics of the job its PromQL selects (a real gateway and a real worker on the bundled model),
every expression parses (promtool, from Debian's prometheus package), and the scrape config, the Grafana
provisioning and the compose file point at each other.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.worker_proc import worker_process

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DASHBOARD = DOCKER / "grafana" / "switchyard.json"
GATEWAY_JOB, WORKER_JOB = "switchyard-gateway", "switchyard-worker"
ADMIN_KEY = "sk-grafana-admin"
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")   # metric{matchers}
JOB = re.compile(r'job="([^"]+)"')


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _targets() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in _panels(dashboard["panels"])
            for target in panel.get("targets", [])]


def _exposed(metrics_text: str) -> set[str]:
    """Every series name a scrape of this text can hold, declared families without samples included."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics_text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def exposed(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, set[str]]]:
    """{job: names in its /metrics} from a real worker and a real gateway that served a request."""
    workdir = tmp_path_factory.mktemp("grafana")
    # A small RAM tier and a store that is not there: the KV tier series exist (the store's as down).
    args = ["--model", "smollm2", "--served-model-name", "smollm2", "--kv-cpu-gb", "0.05",
            "--kv-store", f"mooncake://127.0.0.1:{free_port()}"]
    with worker_process(args, log_dir=workdir) as worker_url:
        config = {
            "api_keys": [{"key_id": "ops", "key": ADMIN_KEY, "admin": True}],
            "models": {"smollm2": {"tokenizer": str(smollm2_dir), "providers": ["local"]}},
            "providers": {"local": {"kind": "openai", "endpoints": [worker_url],
                                    "offers_load": True, "offers_kv_events": True}},
        }
        gateway = GatewayProcess(config, workdir)
        try:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
            assert list(client.chat.completions.create(model="smollm2", max_tokens=4, stream=True,
                                                       messages=[{"role": "user", "content": "Hi"}]))
            request = urllib.request.Request(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            with urllib.request.urlopen(request, timeout=10) as response:
                gateway_text = response.read().decode()
            with urllib.request.urlopen(worker_url + "/metrics", timeout=10) as response:
                worker_text = response.read().decode()
            yield {GATEWAY_JOB: _exposed(gateway_text), WORKER_JOB: _exposed(worker_text)}
        finally:
            gateway.stop()


@pytest.mark.slow
def test_every_panel_metric_exists_in_its_jobs_metrics(exposed: dict[str, set[str]]) -> None:
    checked = 0
    for title, expr in _targets():
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{title}: no metric selector in {expr!r}"
        for metric, matchers in selectors:
            jobs = JOB.findall(matchers)
            assert len(jobs) == 1 and jobs[0] in exposed, f"{title}: {metric} must select one job of {sorted(exposed)}"
            assert metric in exposed[jobs[0]], f"{title}: {metric} is not in the /metrics of {jobs[0]}"
            checked += 1
    assert checked >= 40


def test_dashboard_covers_the_issue_list() -> None:
    """Request rate, errors, TTFT/ITL percentiles, in-flight tokens per endpoint, KV use, prefix hits, breakers."""
    exprs = " ".join(expr for _, expr in _targets())
    for metric in ("switchyard_requests_total", "switchyard_upstream_errors_total", "switchyard_ttft_seconds_bucket",
                   "switchyard_inter_token_latency_seconds_bucket", "switchyard_inflight_tokens",
                   "switchyard_kv_cache_usage_ratio", "switchyard_prefix_cache_hit_rate", "switchyard_circuit_state"):
        assert metric + "{" in exprs, metric


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (apt-get install -y prometheus; make test does this)")
    return path


def test_every_expression_parses_as_promql(tmp_path: Path) -> None:
    # Grafana substitutes $__rate_interval before the query reaches Prometheus.
    rules = [{"record": f"dashboard:target_{i}", "expr": expr.replace("$__rate_interval", "1m")}
             for i, (_, expr) in enumerate(_targets())]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_scrape_config_provisioning_and_compose_agree() -> None:
    out = subprocess.run([_promtool(), "check", "config", "--syntax-only", str(DOCKER / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == {GATEWAY_JOB, WORKER_JOB}
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    worker_services = {name for name in jobs[WORKER_JOB]["dns_sd_configs"][0]["names"]}
    assert worker_services == {"prefill", "decode", "both"} <= set(compose)
    assert jobs[GATEWAY_JOB]["dns_sd_configs"][0]["names"] == ["gateway"]
    # The gateway job's key file is the one the prometheus service writes from SWITCHYARD_METRICS_KEY.
    key_file = jobs[GATEWAY_JOB]["authorization"]["credentials_file"]
    assert key_file in " ".join(compose["prometheus"]["entrypoint"])
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in compose["prometheus"]["volumes"]
    gateway_config = yaml.safe_load((DOCKER / "gateway.yaml").read_text())
    assert any(key["admin"] and key["key"] == "${SWITCHYARD_METRICS_KEY}" for key in gateway_config["api_keys"]
               if "admin" in key)

    datasources = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
    providers = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/switchyard.yaml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    assert f"./grafana/switchyard.json:{folder}/switchyard.json:ro" in compose["grafana"]["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in compose["grafana"]["volumes"]


def test_panels_do_not_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in _panels(json.loads(DASHBOARD.read_text())["panels"]):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for y in range(grid["y"], grid["y"] + grid["h"]):
            for x in range(grid["x"], grid["x"] + grid["w"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]
