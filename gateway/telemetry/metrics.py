"""Prometheus metrics of one gateway app: a private registry, label children cached per key.

In-flight load and circuit states are read at scrape time (a collector), so the hot path only
increments counters. No module-level registry: two apps in one process do not share metrics.

The counters and histograms are this module's own (`LabelledCounter`, `LabelledHistogram`), for code that runs
on one event loop's thread: an event is a dict update, with no lock and no per-label child object, read at
scrape time through `CountsCollector` in the same exposition as prometheus_client's own (less their `_created`
samples). prometheus_client's metrics take a lock on every increment and walk their buckets in Python; on the
gateway's hot path that was about 5% of its instructions per request (docs/gateway_performance.md).
"""
from __future__ import annotations

import asyncio
import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Mean gaps between a stream's output tokens (a CPU worker's decode step is 20-100 ms).
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# One row per endpoint at scrape time: (endpoint_id, num_requests, num_prefill_tokens, num_decode_tokens, circuit),
# the circuit as routing/endpoints.py's CircuitState (an IntEnum: 0 closed, 1 half-open, 2 open)
EndpointRow = tuple[str, int, int, int, int]
# One row per endpoint, poller and cause that failed: (endpoint_id, poller, cause, failures so far)
PollFailureRow = tuple[str, str, str, int]


class _EndpointCollector(Collector):
    def __init__(self, rows: Callable[[], Iterable[EndpointRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterable[GaugeMetricFamily]:
        requests = GaugeMetricFamily("switchyard_inflight_requests", "Requests in flight per endpoint",
                                     labels=["endpoint"])
        tokens = GaugeMetricFamily("switchyard_inflight_tokens", "Tokens in flight per endpoint (prefill still to "
                                   "compute, decode still to produce)", labels=["endpoint", "phase"])
        circuit = GaugeMetricFamily("switchyard_circuit_state", "Circuit breaker state (0 closed, 1 half-open, "
                                    "2 open)", labels=["endpoint"])
        for endpoint, num_requests, num_prefill, num_decode, state in self._rows():
            requests.add_metric([endpoint], num_requests)
            tokens.add_metric([endpoint, "prefill"], num_prefill)
            tokens.add_metric([endpoint, "decode"], num_decode)
            circuit.add_metric([endpoint], int(state))
        yield requests
        yield tokens
        yield circuit


class _PollFailureCollector(Collector):
    def __init__(self, rows: Callable[[], Iterable[PollFailureRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterable[CounterMetricFamily]:
        failures = CounterMetricFamily("switchyard_poll_failures", "Failed background polls of an endpoint by "
                                       "poller (health, load, kv_events, vllm_metrics) and cause (unreachable, "
                                       "bad_response: an HTTP error or a body that does not parse)",
                                       labels=["endpoint", "poller", "cause"])
        for endpoint, poller, cause, count in self._rows():
            failures.add_metric([endpoint, poller, cause], count)
        yield failures


class _KvEventCollector(Collector):
    def __init__(self, rows: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._rows = rows

    def collect(self) -> Iterable[CounterMetricFamily]:
        batches = CounterMetricFamily("switchyard_kv_event_batches", "KV event batches from an engine (vLLM's "
                                      "ZMQ publisher) applied to the prefix index", labels=["endpoint"])
        for endpoint, count in self._rows():
            batches.add_metric([endpoint], count)
        yield batches


class _RuntimeCollector(Collector):
    """asyncio tasks alive at scrape time: a count that grows under steady load is a leak."""

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            num_tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped outside the loop (a test rendering directly)
            num_tasks = 0
        yield GaugeMetricFamily("switchyard_asyncio_tasks", "asyncio tasks alive in the gateway", value=num_tasks)
        # Which process answered: with `--workers N` a scrape reaches one of N processes on the port.
        yield GaugeMetricFamily("switchyard_process_id", "The answering gateway process's pid", value=os.getpid())


class Metrics:
    """The gateway's counters and histograms (below: a dict update per event)."""

    def __init__(self, endpoint_rows: Callable[[], Iterable[EndpointRow]],
                 poll_failure_rows: Callable[[], Iterable[PollFailureRow]] = tuple,
                 kv_event_rows: Callable[[], Iterable[tuple[str, int]]] = tuple) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._requests = LabelledCounter("switchyard_requests", "Requests by model and HTTP status",
                                         ["model", "status"])
        self._errors = LabelledCounter("switchyard_upstream_errors", "Failed upstream legs by provider and cause",
                                       ["provider", "cause"])
        self._retries = LabelledCounter("switchyard_retries", "Upstream legs retried, by model", ["model"])
        self._fallbacks = LabelledCounter("switchyard_fallbacks", "Moves to the next provider in a chain",
                                          ["model", "from_provider", "to_provider"])
        self._latency = LabelledHistogram("switchyard_upstream_latency_seconds", "Upstream leg duration by leg "
                                          "kind (single, prefill, decode)", ["provider", "leg"], _LATENCY_BUCKETS)
        self._pd_fallbacks = LabelledCounter("switchyard_pd_fallbacks", "Disaggregated requests handed to the "
                                             "next provider, by cause", ["model", "provider", "cause"])
        self._pd_redos = LabelledCounter("switchyard_pd_redos", "Disaggregated requests whose decode leg did not get "
                                         "the prefill's KV, redone without it, by the decode worker's error code",
                                         ["model", "code"])
        self._ttft = LabelledHistogram("switchyard_ttft_seconds", "Time to the first byte relayed to the client",
                                       ["model"], _LATENCY_BUCKETS)
        self._itl = LabelledHistogram("switchyard_itl_seconds", "Mean time between output tokens of each streamed "
                                      "response, after its first token", ["model"], _ITL_BUCKETS)
        self._decisions = LabelledCounter("switchyard_routing_decisions", "Routing decisions by reason",
                                          ["model", "reason"])
        self._moves = LabelledCounter("switchyard_session_moves", "Sessions re-homed to another endpoint", ["model"])
        self._shared = LabelledCounter("switchyard_shared_routing_decisions", "Peer processes' routing decisions "
                                       "to endpoints without KV events, applied to this process's approximate "
                                       "prefix index")
        self._stream_errors = LabelledCounter("switchyard_stream_errors", "Streams ended by an upstream failure "
                                              "after the first byte", ["model"])
        self._failovers = LabelledCounter("switchyard_stream_failovers", "Streams whose upstream failed after the "
                                          "first byte, by what followed: continued elsewhere, failed (no endpoint "
                                          "took the continuation), not continuable (tool calls, an error event), "
                                          "no retry budget left", ["model", "outcome"])
        self._cache = LabelledCounter("switchyard_response_cache", "Requests the response cache answered (hit), "
                                      "looked up in vain (miss) or could not serve (bypass: sampled, skipped)",
                                      ["model", "result"])
        self._tokens = LabelledCounter("switchyard_tokens", "Tokens the upstreams served, by model, API key (\"\" "
                                       "without keys) and kind: prompt (cached ones included), cached (prompt "
                                       "tokens read from a prefix cache), completion", ["model", "key", "kind"])
        r.register(CountsCollector([
            self._requests, self._errors, self._retries, self._fallbacks, self._latency, self._pd_fallbacks,
            self._pd_redos, self._ttft, self._itl, self._decisions, self._moves, self._shared, self._stream_errors,
            self._failovers, self._cache, self._tokens]))
        r.register(_EndpointCollector(endpoint_rows))
        r.register(_PollFailureCollector(poll_failure_rows))
        r.register(_KvEventCollector(kv_event_rows))
        r.register(_RuntimeCollector())
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, CPU seconds

    def on_request(self, model: str, status: int) -> None:
        self._requests.inc((model, str(status)))

    def on_tokens(self, model: str, key: str, num_prompt: int, num_cached: int, num_completion: int) -> None:
        tokens = self._tokens
        tokens.inc((model, key, "prompt"), num_prompt)
        if num_cached:
            tokens.inc((model, key, "cached"), num_cached)
        tokens.inc((model, key, "completion"), num_completion)

    def on_upstream_error(self, provider: str, cause: str) -> None:
        self._errors.inc((provider, cause))

    def on_retry(self, model: str) -> None:
        self._retries.inc((model,))

    def on_fallback(self, model: str, from_provider: str, to_provider: str) -> None:
        self._fallbacks.inc((model, from_provider, to_provider))

    def observe_upstream(self, provider: str, leg: str, seconds: float) -> None:
        self._latency.observe((provider, leg), seconds)

    def on_pd_fallback(self, model: str, provider: str, cause: str) -> None:
        self._pd_fallbacks.inc((model, provider, cause))

    def on_pd_redo(self, model: str, code: str) -> None:
        self._pd_redos.inc((model, code))

    def observe_ttft(self, model: str, seconds: float) -> None:
        self._ttft.observe((model,), seconds)

    def observe_itl(self, model: str, seconds: float) -> None:
        self._itl.observe((model,), seconds)

    def on_decision(self, model: str, reason: str) -> None:
        self._decisions.inc((model, reason))

    def on_response_cache(self, model: str, result: str) -> None:
        self._cache.inc((model, result))

    def on_session_move(self, model: str) -> None:
        self._moves.inc((model,))

    def on_shared_decisions(self, num_decisions: int) -> None:
        self._shared.inc((), num_decisions)

    def on_stream_error(self, model: str) -> None:
        self._stream_errors.inc((model,))

    def on_failover(self, model: str, outcome: str) -> None:
        self._failovers.inc((model, outcome))

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
