"""The worker's live status page: GET /status (static HTML whose script polls) and GET /status.json.

The snapshot reads what /metrics reads (the engine's load report and stats, the app's Prometheus
registry), so the two agree. Read-only: it never touches the engine's queues.
"""
from __future__ import annotations

import math
import socket
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from importlib import resources
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from backends.server.app_keys import CONFIG_KEY, ENGINE_KEY, METRICS_KEY

QUANTILES = (0.5, 0.9, 0.99)
# (snapshot name, histogram name) of the request-side latencies ServerMetrics records
_LATENCIES = (("ttft", "switchyard_time_to_first_token_seconds"), ("itl", "switchyard_inter_token_latency_seconds"),
              ("e2e", "switchyard_request_duration_seconds"))

Samples = Mapping[str, list[tuple[dict[str, str], float]]]


def routes() -> list[web.RouteDef]:
    page = resources.files("backends.server").joinpath("status.html").read_bytes()   # read once

    async def status_page(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    return [web.get("/status", status_page), web.get("/status.json", status_json)]


async def status_json(request: web.Request) -> web.Response:
    body = orjson.dumps(snapshot(request.app))
    return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})


def snapshot(app: web.Application) -> dict[str, Any]:
    """Everything the page shows; counters are cumulative (the page derives rates such as tokens/s)."""
    config, engine = app[CONFIG_KEY], app[ENGINE_KEY]
    report, stats = engine.load_report(), engine.stats()
    samples = collect(app[METRICS_KEY].registry)
    used = report.num_total_blocks - report.num_free_blocks     # as kv_blocks_used in /metrics
    return {
        "kind": "worker",
        "host": socket.gethostname(),
        "time_s": time.time(),
        "models": list(config.served_model_names),
        "role": config.role.value,
        "max_model_len": engine.max_model_len,
        "load": asdict(report),
        "kv": {
            "num_total_blocks": report.num_total_blocks,
            "num_used_blocks": used,
            "num_free_blocks": report.num_free_blocks,
            "num_cached_blocks": report.num_cached_blocks,
            "num_held_blocks": report.num_held_blocks,
            "used_fraction": used / report.num_total_blocks if report.num_total_blocks else 0.0,
        },
        "stats": {**asdict(stats), "prefix_hit_rate": stats.prefix_hit_rate},
        "latency": {name: histogram(samples, metric) for name, metric in _LATENCIES},
        "requests": _requests(samples),
    }


def _requests(samples: Samples) -> list[dict[str, Any]]:
    """HTTP requests by route and status, the API routes first."""
    rows = [{"route": labels["route"], "status": labels["status"], "count": int(value)}
            for labels, value in samples.get("switchyard_requests_total", [])]
    return sorted(rows, key=lambda r: (not r["route"].startswith("/v1/"), r["route"], r["status"]))


# --- reading a Prometheus registry (the gateway's page has its own copy: the two never import each other) ---

def collect(registry: CollectorRegistry) -> Samples:
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in registry.collect():
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _values(samples: Samples, name: str) -> Iterable[tuple[dict[str, str], float]]:
    return samples.get(name, [])


def histogram(samples: Samples, name: str) -> dict[str, Any]:
    """Count, sum, quantiles (interpolated within buckets, as PromQL's histogram_quantile) and the finite
    buckets as [upper bound, cumulative count] pairs, for the page's own windowed quantiles."""
    buckets = sorted((float(labels["le"]), value) for labels, value in _values(samples, f"{name}_bucket"))
    count = int(sum(value for _, value in _values(samples, f"{name}_count")))
    out: dict[str, Any] = {"count": count, "sum_s": sum(value for _, value in _values(samples, f"{name}_sum")),
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
