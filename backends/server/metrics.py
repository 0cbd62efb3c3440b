"""The worker's Prometheus metrics, in a registry of its own (one per app, never the global one).

Request-side figures (latencies, statuses) are recorded as requests run; engine state and
counters (sequences, KV blocks, tokens, prefix hits, preemptions) are read at scrape time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from backends.core.outputs import LoadReport
    from backends.engine.engine import EngineStats

PREFIX = "switchyard"
_TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)
# (metric name without prefix and _total, EngineStats field, help): cumulative engine counters.
_ENGINE_COUNTERS = (
    ("prompt_tokens", "num_prompt_tokens", "Prompt tokens of sequences whose prefill completed."),
    ("prompt_cached_tokens", "num_cached_prompt_tokens", "Prompt tokens served from the prefix cache."),
    ("generation_tokens", "num_generation_tokens", "Output tokens sampled."),
    ("preemptions", "num_preemptions", "Sequences preempted for KV space (recomputed later)."),
    ("finished_sequences", "num_finished_sequences", "Sequences ended for any reason."),
    ("failed_sequences", "num_failed_sequences", "Sequences ended by an engine error."),
    ("engine_steps", "num_steps", "Forward steps run."),
)


class EngineCollector(Collector):
    """Reads the engine's load report and stats on every scrape, so the figures are never stale."""

    def __init__(self, load_report: Callable[[], LoadReport], stats: Callable[[], EngineStats]) -> None:
        self._load_report = load_report
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        report = self._load_report()
        used = report.num_total_blocks - report.num_free_blocks
        yield _gauge("num_requests_running", "Sequences admitted (prefilling or decoding).", report.num_running)
        yield _gauge("num_requests_waiting", "Sequences waiting for admission.", report.num_waiting)
        yield _gauge("kv_blocks_total", "KV cache blocks in all.", report.num_total_blocks)
        yield _gauge("kv_blocks_free", "KV cache blocks free (evictable cached ones included).", report.num_free_blocks)
        yield _gauge("kv_blocks_used", "KV cache blocks held by sequences.", used)
        yield _gauge("kv_blocks_cached", "KV blocks reusable by prefix hash (in use or not).", report.num_cached_blocks)
        yield _gauge("kv_cache_usage_ratio", "Fraction of KV blocks held by sequences.",
                     used / report.num_total_blocks if report.num_total_blocks else 0.0)
        if report.kv_tiers:
            yield from _tier_metrics(report)
        if report.seconds_per_prompt_token is not None:
            yield _gauge("prompt_token_seconds", "A prompt token's compute, fitted from step times (with KV tiers).",
                         report.seconds_per_prompt_token)
        stats = self._stats()
        yield _gauge("prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens, over the worker's life.",
                     stats.prefix_hit_rate)
        for name, field, documentation in _ENGINE_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", documentation, value=getattr(stats, field))
        if stats.speculative:
            for name, value, documentation in (
                    ("spec_proposed_tokens", stats.num_spec_proposed_tokens, "Draft tokens the target verified."),
                    ("spec_accepted_tokens", stats.num_spec_accepted_tokens, "Draft tokens the target accepted."),
                    ("spec_verifications", stats.num_spec_verifications,
                     "Sequence-steps that verified at least one draft.")):
                family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=["proposer"])
                family.add_metric([stats.speculative], value)
                yield family
            rate = GaugeMetricFamily(f"{PREFIX}_spec_acceptance_rate",
                                     "Accepted / proposed draft tokens, over the worker's life.", labels=["proposer"])
            rate.add_metric([stats.speculative], stats.spec_acceptance_rate)
            yield rate


def _tier_metrics(report: LoadReport) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The KV tiers below the device pool, one series per medium."""
    families = (
        (GaugeMetricFamily, "kv_tier_blocks", "KV blocks a tier holds (-1: a shared store, not counted).",
         "num_blocks"),
        (GaugeMetricFamily, "kv_tier_used_bytes", "Bytes a KV tier holds.", "used_bytes"),
        (GaugeMetricFamily, "kv_tier_capacity_bytes", "A KV tier's size (0: unknown, a shared store).",
         "capacity_bytes"),
        (CounterMetricFamily, "kv_tier_restored_blocks", "KV blocks loaded back from a tier into the device pool.",
         "num_restored_blocks"),
        (CounterMetricFamily, "kv_tier_written_blocks", "KV blocks written into a tier.", "num_written_blocks"),
        (CounterMetricFamily, "kv_tier_failed_writes", "KV blocks a tier did not keep when written (full of "
         "blocks in use, an I/O error, or down).", "num_failed_writes"),
        (GaugeMetricFamily, "kv_tier_up", "1 while a tier is reachable (a shared store can be down).", "up"),
        (CounterMetricFamily, "kv_tier_outages", "Times a tier went down (the worker ran on without it).",
         "num_outages"),
        (CounterMetricFamily, "kv_tier_restore_seconds", "Time spent reading KV blocks back from a tier.",
         "restore_seconds"),
    )
    for cls, name, documentation, attr in families:
        family = cls(f"{PREFIX}_{name}", documentation, labels=["medium"])
        for tier in report.kv_tiers:
            family.add_metric([tier.medium], float(getattr(tier, attr)))
        yield family
    fraction = GaugeMetricFamily(f"{PREFIX}_kv_tier_restore_fraction",
                                 "Reading a token back from a tier, as a fraction of computing it (once measured).",
                                 labels=["medium"])
    for tier in report.kv_tiers:
        if tier.restore_fraction is not None:
            fraction.add_metric([tier.medium], tier.restore_fraction)
    yield fraction
    yield CounterMetricFamily(f"{PREFIX}_kv_tier_dropped_writes",
                              "Evicted KV blocks not written down because the write queue was full.",
                              value=report.num_kv_dropped_writes)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=value)


class ServerMetrics:
    """All metrics of one worker app; `render()` is the /metrics body."""

    def __init__(self, engine_collector: Collector | None = None, weights: str = "") -> None:
        """`weights`: the fingerprint of the weights served (backends/worker/fingerprint.py), shown as
        `switchyard_model_weights_info{weights=...}`: workers that may share KV show one value (during a rolling
        upgrade, it tells the revisions apart)."""
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        if weights:
            Info(f"{PREFIX}_model_weights", "Fingerprint of the weights this worker serves.",
                 registry=reg).info({"weights": weights})
        self.requests = Counter(f"{PREFIX}_requests", "Finished HTTP requests by route and status.",
                                ["route", "status"], registry=reg)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_TTFT_BUCKETS_S, registry=reg)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between output steps.",
                             buckets=_ITL_BUCKETS_S, registry=reg)
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds", "Arrival to last output token.",
                             buckets=_E2E_BUCKETS_S, registry=reg)
        self.kv_refused = Counter(f"{PREFIX}_kv_transfer_refused_connections",
                                  "KV-transfer connections refused for want of the pool's key (reason: missing "
                                  "or wrong proof).", ["reason"], registry=reg)
        for reason in ("missing", "wrong"):   # both series exist from the start, at 0
            self.kv_refused.labels(reason=reason)
        if engine_collector is not None:
            reg.register(engine_collector)

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_next_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)

    def observe_request_duration(self, duration_s: float) -> None:
        self.e2e.observe(duration_s)

    def observe_kv_refused(self, reason: str) -> None:
        self.kv_refused.labels(reason=reason).inc()

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
