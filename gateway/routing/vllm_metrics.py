"""vLLM's Prometheus `/metrics` read as a load report, for endpoints that serve no `/load`.

What vLLM tells: requests running and waiting, the KV cache's used fraction and, from
`vllm:cache_config_info`'s labels, its size in blocks. What it does not tell (tokens still to prefill
or decode) is reported as 0, so `LoadTracker` adds other clients' requests but none of their tokens.
Parses only the few series it needs; every engine's (data-parallel rank's) samples are summed.
"""
from __future__ import annotations

import math
import re

from gateway.routing.load import LoadReport

# name{labels} value  (a sample line of the text exposition format; no timestamps from vLLM)
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_WANTED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")


def load_report_from_metrics(text: str) -> LoadReport:
    """A `LoadReport` from vLLM's metrics text; ValueError when it has no request gauges (not vLLM)."""
    sums: dict[str, float] = {}
    usage: list[float] = []
    num_total_blocks = block_size = 0
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw_value = match.groups()
        value = float(raw_value)
        if not math.isfinite(value):
            continue
        if name == "vllm:cache_config_info":
            info = dict(_LABEL.findall(labels or ""))
            num_total_blocks += _int_label(info, "num_gpu_blocks")
            block_size = block_size or _int_label(info, "block_size")
        elif name.endswith("cache_usage_perc"):
            usage.append(min(1.0, max(0.0, value)))
        else:
            sums[name] = sums.get(name, 0.0) + value
    if "vllm:num_requests_running" not in sums or "vllm:num_requests_waiting" not in sums:
        raise ValueError("no vllm:num_requests_running / vllm:num_requests_waiting in /metrics")
    used = sum(usage) / len(usage) if usage else 0.0
    return LoadReport(
        num_running=round(sums["vllm:num_requests_running"]),
        num_waiting=round(sums["vllm:num_requests_waiting"]),
        num_prefill_tokens_pending=0, num_decode_tokens_pending=0,
        num_free_blocks=round(num_total_blocks * (1.0 - used)) if block_size else 0,
        num_total_blocks=num_total_blocks if block_size else 0,
        num_cached_blocks=0, block_size=block_size)


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return max(0, int(labels.get(name) or 0))
    except ValueError:
        return 0
