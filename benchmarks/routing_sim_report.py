"""routing_sim.py's results: one summary per simulated policy (hit rates, TTFT percentiles, imbalance), its
table row, and issue 14's targets checked against the unlimited cache's row."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from routing_sim_tiers import Medium, missed_targets

if TYPE_CHECKING:
    from routing_sim import Simulation
    from routing_sim_rows import Row

UNLIMITED = "unlimited cache"


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(name: str, sim: Simulation, wall_s: float) -> dict[str, Any]:
    ttfts = sorted(f.ttft_s for f in sim.finished)
    prompt = sum(f.request.num_prompt_tokens for f in sim.finished)
    cached = sum(f.num_cached_tokens for f in sim.finished)
    by_medium = [sum(f.cached_tokens_by_medium[m] for f in sim.finished) for m in Medium]
    busy = [w.prefill_busy_s for w in sim.workers]
    counts = [w.num_requests for w in sim.workers]
    arrivals = [f.request.arrival_s for f in sim.finished]
    span_s = max(arrivals) - min(arrivals)
    leftover = [sim.tracker.snapshot(w.endpoint_id) for w in sim.workers]
    assert all(s == (0, 0, 0) for s in leftover), leftover  # every lease released
    return {"policy": name, "hit_rate": cached / prompt,
            "block_hit_rate": (sum(f.num_cached_blocks for f in sim.finished)
                               / sum(len(f.request.block_hashes) for f in sim.finished)),
            "hit_rate_by_medium": {m.name.lower(): n / prompt for m, n in zip(Medium, by_medium, strict=True)},
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "busy_imbalance": max(busy) / statistics.fmean(busy),
            "request_imbalance": max(counts) / statistics.fmean(counts),
            # the share of the trace's span that the mean and the busiest worker spent prefilling
            "prefill_utilization": (statistics.fmean(busy) / span_s, max(busy) / span_s),
            "moved": sim.num_moved, "wall_s": wall_s}


def print_row(row: dict[str, Any], unlimited: dict[str, Any] | None) -> None:
    share = f"{row['hit_rate'] / unlimited['hit_rate']:.1%}" if unlimited else "-"
    media = "/".join(f"{v:.0%}" for v in row["hit_rate_by_medium"].values())
    print(f"{row['policy']:<46}{row['hit_rate']:>9.1%}{row['block_hit_rate']:>8.1%}{share:>9}"
          f"{row['ttft_mean_s']:>10.2f}s{row['ttft_p50_s']:>7.2f}s{row['ttft_p90_s']:>7.2f}s{row['ttft_p99_s']:>7.2f}s"
          f"{row['busy_imbalance']:>7.2f}{row['request_imbalance']:>7.2f}{row['moved']:>6}  {media:<16}"
          f"{'/'.join(f'{u:.0%}' for u in row['prefill_utilization']):>9}"
          f"{row['wall_s']:>5.1f}s")


def print_approx_ratios(results: dict[str, dict[str, Any]]) -> None:
    """The approximate index's hit rate against the precise one's, alone and shared between processes."""
    if "prefix_aware precise" in results and "prefix_aware approx" in results:
        ratio = results["prefix_aware approx"]["hit_rate"] / results["prefix_aware precise"]["hit_rate"]
        print(f"approximate reaches {ratio:.1%} of precise's hit rate")
    if "prefix_aware precise" in results and "prefix_aware approx shared" in results:
        ratio = results["prefix_aware approx shared"]["hit_rate"] / results["prefix_aware precise"]["hit_rate"]
        print(f"approximate, shared between processes, reaches {ratio:.1%} of precise's hit rate")


def print_targets(results: dict[str, dict[str, Any]], rows: list[Row], unlimited_blocks: float) -> None:
    unlimited, best = results.get(UNLIMITED), results.get("prefix_aware")
    if unlimited is None or best is None:
        return
    print(f"issue 14's targets: hit rate >= 95% of unlimited's; blocks >= 95% of {unlimited_blocks:.1%} "
          f"(unlimited, trace order); busiest/mean busy <= 1.1; TTFT p50 <= {best['ttft_p50_s']:.2f} s / 2")
    for spec in rows:
        if spec.label in results and spec.tiers.enabled and spec.label != UNLIMITED:
            missed = missed_targets(results[spec.label], unlimited, best, unlimited_blocks)
            print(f"  {spec.label:<46}{'all met' if not missed else 'missed: ' + ' '.join(missed)}")
