"""The /metrics body: engine figures read at scrape time, request figures as they are observed."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from backends.engine.async_engine import EngineStats, LoadReport
from backends.server.metrics import EngineCollector, ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_engine_figures_are_read_at_scrape_time() -> None:
    state = {"report": LoadReport(3, 2, 40, 100, 70, 100, 12, 16),
             "stats": EngineStats(200, 50, 30, 1, 4, 0, 9)}
    metrics = ServerMetrics(EngineCollector(lambda: state["report"], lambda: state["stats"]))
    first = samples(metrics)
    assert first[("switchyard_num_requests_running", ())] == 3
    assert first[("switchyard_num_requests_waiting", ())] == 2
    assert first[("switchyard_kv_blocks_free", ())] == 70
    assert first[("switchyard_kv_blocks_used", ())] == 30
    assert first[("switchyard_kv_cache_usage_ratio", ())] == 0.3
    assert first[("switchyard_prompt_tokens_total", ())] == 200
    assert first[("switchyard_prompt_cached_tokens_total", ())] == 50
    assert first[("switchyard_prefix_cache_hit_rate", ())] == 0.25
    assert first[("switchyard_preemptions_total", ())] == 1
    state["report"] = LoadReport(0, 0, 0, 0, 100, 100, 12, 16)
    state["stats"] = EngineStats(300, 150, 60, 1, 6, 0, 20)
    second = samples(metrics)
    assert second[("switchyard_num_requests_running", ())] == 0
    assert second[("switchyard_kv_blocks_used", ())] == 0
    assert second[("switchyard_prefix_cache_hit_rate", ())] == 0.5


def test_request_figures() -> None:
    metrics = ServerMetrics()
    metrics.observe_request("/v1/completions", 200)
    metrics.observe_request("/v1/completions", 200)
    metrics.observe_request("/v1/completions", 400)
    metrics.observe_first_token(0.03)
    metrics.observe_next_token(0.012)
    metrics.observe_next_token(0.5)
    got = samples(metrics)
    assert got[("switchyard_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 2
    assert got[("switchyard_requests_total", (("route", "/v1/completions"), ("status", "400")))] == 1
    assert got[("switchyard_time_to_first_token_seconds_count", ())] == 1
    assert got[("switchyard_inter_token_latency_seconds_count", ())] == 2
    assert got[("switchyard_inter_token_latency_seconds_bucket", (("le", "0.015"),))] == 1


def test_each_app_has_its_own_registry() -> None:
    one, two = ServerMetrics(), ServerMetrics()
    one.observe_request("/health", 200)
    assert ("switchyard_requests_total", (("route", "/health"), ("status", "200"))) not in samples(two)


def test_the_weights_fingerprint_is_an_info_metric_where_known() -> None:
    assert samples(ServerMetrics(weights="f00d"))[("switchyard_model_weights_info", (("weights", "f00d"),))] == 1
    assert not any(name.startswith("switchyard_model_weights") for name, _ in samples(ServerMetrics()))
