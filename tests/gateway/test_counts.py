"""The lock-free counters of gateway/telemetry/metrics.py against prometheus_client's own Counter and Histogram:
the same events give the same samples in the exposition (less prometheus_client's `_created` ones)."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import CountsCollector, LabelledCounter, LabelledHistogram

BUCKETS = (0.0005, 0.001, 0.0025, 0.01, 0.1, 1, 2.5)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_counters_and_histograms_expose_what_prometheus_client_does() -> None:
    rng = random.Random(0)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    their_counter = Counter("demo_requests", "Requests", ["model", "status"], registry=theirs)
    their_total = Counter("demo_shared", "No labels", registry=theirs)
    their_histogram = Histogram("demo_seconds", "Durations", ["model"], buckets=BUCKETS, registry=theirs)
    counter = LabelledCounter("demo_requests", "Requests", ["model", "status"])
    total = LabelledCounter("demo_shared", "No labels")
    histogram = LabelledHistogram("demo_seconds", "Durations", ["model"], BUCKETS)
    ours.register(CountsCollector([counter, total, histogram]))
    for _ in range(500):
        model, status = rng.choice(["a", "b"]), rng.choice(["200", "429", "503"])
        their_counter.labels(model, status).inc()
        counter.inc((model, status))
        # Values on the bucket bounds too: `le` is inclusive in both.
        seconds = rng.choice([rng.uniform(0, 3), rng.choice(BUCKETS), 10.0])
        their_histogram.labels(model).observe(seconds)
        histogram.observe((model,), seconds)
        amount = rng.randint(1, 5)
        their_total.inc(amount)
        total.inc((), amount)

    expected, got = _samples(theirs), _samples(ours)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key


def test_histogram_buckets_must_increase_and_counters_only_go_up() -> None:
    with pytest.raises(ValueError, match="increasing"):
        LabelledHistogram("demo_seconds", "Durations", ["model"], (0.1, 0.05))
    with pytest.raises(ValueError, match="only goes up"):
        LabelledCounter("demo_requests", "Requests").inc((), -1)   # as prometheus_client's Counter.inc(-1)
