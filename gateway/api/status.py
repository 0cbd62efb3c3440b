"""The live status page: GET /status (static HTML whose script polls) and GET /status.json (a snapshot).

The snapshot reads the same sources as /metrics (the app's Prometheus registry, and the endpoint registry
behind its collector), so the page never disagrees with a scrape. Read-only: it never routes or changes state.
"""
from __future__ import annotations

import math
import socket
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.routing.endpoints import CircuitState
from gateway.routing.load import TIER_MEDIA
from gateway.services import SERVICES, Services
from gateway.state import StoreUnavailable

QUANTILES = (0.5, 0.9, 0.99)

# name -> [(labels, value)], as a scrape would show them
Samples = Mapping[str, list[tuple[dict[str, str], float]]]


def routes() -> list[web.RouteDef]:
    page = resources.files("gateway").joinpath("status.html").read_bytes()   # read once, with the route table

    async def status_page(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    return [web.get("/status", status_page), web.get("/status.json", status_json)]


async def status_json(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    try:
        num_sessions: int | None = await services.store.count_sessions()
    except StoreUnavailable:    # the page still shows everything else
        num_sessions = None
    body = orjson.dumps(snapshot(services, num_sessions))
    return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})


def snapshot(services: Services, num_sessions: int | None) -> dict[str, Any]:
    """Everything the page shows, as plain JSON; counts are cumulative (the page derives rates).
    `num_sessions`: live sessions in the state store (all replicas), None when it could not be read."""
    samples = collect(services.metrics.registry)
    start_s = _value(samples, "process_start_time_seconds")
    now_s = time.time()
    return {
        "kind": "gateway",
        "host": socket.gethostname(),   # which replica answered (behind a load balancer, each poll may differ)
        "time_s": now_s,
        "uptime_s": now_s - start_s if start_s else None,
        "num_sessions": num_sessions,
        "endpoints": _endpoints(services),
        "models": [_model(samples, name) for name in services.config.models],
        "providers": _providers(samples, services.config.providers),
        "process": {
            "resident_memory_bytes": _value(samples, "process_resident_memory_bytes"),
            "open_fds": _value(samples, "process_open_fds"),
            "cpu_seconds": _value(samples, "process_cpu_seconds_total"),
            "asyncio_tasks": _value(samples, "switchyard_asyncio_tasks"),
        },
    }


def _endpoints(services: Services) -> list[dict[str, Any]]:
    registry = services.registry
    pools: dict[str, list[str]] = defaultdict(list)
    for (provider, pool), endpoints in registry.pools.items():
        for endpoint in endpoints:
            pools[endpoint.endpoint_id].append(f"{provider}/{pool.name.lower()}")
    rows = []
    for endpoint_id, num_requests, num_prefill, num_decode, state in registry.rows():
        endpoint = registry.endpoints[endpoint_id]
        kv_free = registry.kv_free_fraction(endpoint_id)
        prompt = registry.prompt_tokens(endpoint_id)
        rows.append({
            "id": endpoint_id,
            "pools": pools[endpoint_id],
            "healthy": endpoint.healthy,
            "health_checked": endpoint.health_checked,
            "circuit": CircuitState(state).name.lower(),
            "num_requests": num_requests,
            "num_prefill_tokens": num_prefill,
            "num_decode_tokens": num_decode,
            "kv_used_fraction": None if kv_free is None else 1.0 - kv_free,
            "num_indexed_blocks": registry.num_indexed_blocks(endpoint_id),
            # The shared KV store its worker reads (its /load's store tier): it is credited with every block that
            # any worker reading that store announced there. None: it names none.
            "kv_store": services.prefix_index.store_of(endpoint_id),
            # Cumulative, from the worker's /load (None: it does not report them); the page takes rates.
            "num_prompt_tokens": None if prompt is None else prompt[0],
            "num_cached_prompt_tokens": None if prompt is None else prompt[1],
            # Reading a token back from each KV tier against computing it, as the worker measured it: what
            # prefix_aware weighs that tier's blocks by (1 - fraction). Media it has not reported are left out.
            "kv_restore_fractions": {medium: f for medium, f in zip(TIER_MEDIA, registry.restore_fractions(endpoint_id),
                                                                     strict=True) if f is not None},
        })
    return rows


def _model(samples: Samples, model: str) -> dict[str, Any]:
    statuses = _by_label(samples, "switchyard_requests_total", "status", model=model)
    decisions = _by_label(samples, "switchyard_routing_decisions_total", "reason", model=model)
    return {
        "model": model,
        "num_requests": sum(statuses.values()),
        "num_errors": sum(n for status, n in statuses.items() if not status.startswith("2")),
        "statuses": statuses,
        "ttft": histogram(samples, "switchyard_ttft_seconds", model=model),
        "itl": histogram(samples, "switchyard_itl_seconds", model=model),
        "decisions": decisions,
        "num_session_moves": _sum(samples, "switchyard_session_moves_total", model=model),
        "num_retries": _sum(samples, "switchyard_retries_total", model=model),
        "num_stream_errors": _sum(samples, "switchyard_stream_errors_total", model=model),
        "response_cache": _by_label(samples, "switchyard_response_cache_total", "result", model=model),
    }


def _providers(samples: Samples, providers: Iterable[str]) -> list[dict[str, Any]]:
    rows = []
    for provider in providers:
        legs = sorted({labels["leg"] for labels, _ in samples.get("switchyard_upstream_latency_seconds_count", [])
                       if labels.get("provider") == provider})
        rows.append({
            "provider": provider,
            "errors": _by_label(samples, "switchyard_upstream_errors_total", "cause", provider=provider),
            "legs": {leg: histogram(samples, "switchyard_upstream_latency_seconds", provider=provider, leg=leg)
                     for leg in legs},
        })
    return rows


# --- reading a Prometheus registry --------------------------------------------------------------------

def collect(registry: CollectorRegistry) -> Samples:
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in registry.collect():
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _matching(samples: Samples, name: str, labels: Mapping[str, str]) -> Iterable[tuple[dict[str, str], float]]:
    for sample_labels, value in samples.get(name, []):
        if all(sample_labels.get(k) == v for k, v in labels.items()):
            yield sample_labels, value


def _value(samples: Samples, name: str) -> float | None:
    values = samples.get(name)
    return values[0][1] if values else None


def _sum(samples: Samples, name: str, **labels: str) -> int:
    return int(sum(value for _, value in _matching(samples, name, labels)))


def _by_label(samples: Samples, name: str, label: str, **labels: str) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for sample_labels, value in _matching(samples, name, labels):
        out[sample_labels[label]] += int(value)
    return dict(out)


def histogram(samples: Samples, name: str, **labels: str) -> dict[str, Any]:
    """Count, sum, quantiles (interpolated within buckets, as PromQL's histogram_quantile) and the finite
    buckets as [upper bound, cumulative count] pairs, for the page's own windowed quantiles."""
    buckets = sorted((float(sample_labels["le"]), value)
                     for sample_labels, value in _matching(samples, f"{name}_bucket", labels))
    count = int(sum(value for _, value in _matching(samples, f"{name}_count", labels)))
    total_s = sum(value for _, value in _matching(samples, f"{name}_sum", labels))
    out: dict[str, Any] = {"count": count, "sum_s": total_s,
                           "buckets": [[bound, int(n)] for bound, n in buckets if math.isfinite(bound)]}
    for q in QUANTILES:
        out[f"p{round(q * 100)}_s"] = quantile(q, buckets)
    return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets, the last one +Inf; None without samples."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower            # beyond the last finite bucket: its bound is all we know
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
