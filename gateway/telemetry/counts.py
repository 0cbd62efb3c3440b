"""Counters and histograms by label values, for code that runs on one event loop's thread: an event is a
dict update, with no lock and no per-label child object. A registry reads them at scrape time through
`CountsCollector`, in the same exposition as prometheus_client's own Counter and Histogram (less their
`_created` samples).

prometheus_client's metrics take a lock on every increment and walk their buckets in Python; on the
gateway's hot path that was about 5% of its instructions per request (docs/gateway_performance.md).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class LabelledCounter:
    """A counter per tuple of label values (`inc(("m", "200"))`)."""

    __slots__ = ("_values", "documentation", "labels", "name")

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        self.name = name                  # without `_total`: the exposition adds it
        self.documentation = documentation
        self.labels = tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, label_values: tuple[str, ...] = (), amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, not by {amount}")
        values = self._values
        values[label_values] = values.get(label_values, 0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for label_values, value in self._values.items():
            family.add_metric(label_values, value)
        return family


class LabelledHistogram:
    """A histogram per tuple of label values; `buckets` are the finite upper bounds (`le`, inclusive)."""

    __slots__ = ("_bounds", "_rows", "documentation", "labels", "name")

    def __init__(self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: buckets must be increasing, got {buckets}")
        self.name = name
        self.documentation = documentation
        self.labels = tuple(labels)
        self._bounds = tuple(float(b) for b in buckets)
        # Per label tuple: the count in each bucket alone (the last one +Inf), then the sum of the values.
        self._rows: dict[tuple[str, ...], list[float]] = {}

    def observe(self, label_values: tuple[str, ...], value: float) -> None:
        row = self._rows.get(label_values)
        if row is None:
            row = self._rows[label_values] = [0.0] * (len(self._bounds) + 2)
        row[bisect_left(self._bounds, value)] += 1
        row[-1] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        names = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for label_values, row in self._rows.items():
            cumulative, buckets = 0.0, []
            for name, count in zip(names, row[:-1], strict=True):
                cumulative += count
                buckets.append((name, cumulative))
            family.add_metric(list(label_values), buckets, row[-1])
        return family


class CountsCollector(Collector):
    """Exposes counters and histograms to a prometheus_client registry."""

    def __init__(self, metrics: Iterable[LabelledCounter | LabelledHistogram]) -> None:
        self._metrics = tuple(metrics)

    def collect(self) -> Iterable[CounterMetricFamily | HistogramMetricFamily]:
        for metric in self._metrics:
            yield metric.family()
