"""The gateway benchmark's last tables, from the medians and rounds gateway_bench.py measured: switchyard
against vllm-router, the scaling across process counts, and each `--gateway-tree` against the first one."""
from __future__ import annotations

from typing import TYPE_CHECKING

from bench_trees import ratio_cell, spread
from gateway_bench_load import NUM_STREAM_TOKENS, percentile

if TYPE_CHECKING:
    from gateway_bench import Round


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return (ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2) if ordered else float("nan")


def print_summary(summary: dict[str, dict[str, float]], rate: float) -> None:
    """The issue's table: switchyard against vllm-router, with the ratio, from this run."""
    ours, theirs = summary.get("gateway"), summary.get("vllm-router")
    if ours is None:
        return
    rows = [("max requests/s, closed loop", "rps", "{:,.0f}"),
            ("CPU per non-streaming request, ms", "cpu_closed", "{:.3f}"),
            (f"CPU per {NUM_STREAM_TOKENS}-chunk stream at {rate:.0f} rps, ms", f"cpu_stream{rate:.0f}", "{:.3f}"),
            (f"added TTFT p50 at {rate:.0f} rps, ms", f"ttft50_{rate:.0f}", "{:+.2f}"),
            (f"added TTFT p99 at {rate:.0f} rps, ms", f"ttft99_{rate:.0f}", "{:+.2f}"),
            ("peak RSS, MB", "rss", "{:.0f}")]
    on_aiohttp = summary.get("gateway-aiohttp")  # the same gateway without its lean server, when measured
    print(f"\n{'':<44}{'switchyard':>12}{'vllm-router':>13}{'ratio':>8}"
          + (f"{'aiohttp-only':>14}{'ratio':>8}" if on_aiohttp else ""))
    for name, key, fmt in rows:
        scale = 1e-3 if key.startswith("cpu") else 1.0
        mine = ours.get(key, float("nan")) * scale
        base = theirs.get(key, float("nan")) * scale if theirs else float("nan")
        ratio = mine / base if base and base == base else float("nan")
        line = f"{name:<44}{fmt.format(mine):>12}{fmt.format(base):>13}{ratio:>8.2f}"
        if on_aiohttp:
            before = on_aiohttp.get(key, float("nan")) * scale
            line += f"{fmt.format(before):>14}{mine / before if before else float('nan'):>8.2f}"
        print(line)


def print_scaling(summary: dict[str, dict[str, float]], counts: list[tuple[int, str, str | None]]) -> None:
    """Closed-loop req/s per process count (CPUs), each against its own first count, and direct beside."""
    print(f"\n{'processes (cpus)':<20}{'switchyard req/s':>18}{'scaling':>9}{'vllm-router req/s':>19}{'scaling':>9}"
          f"{'direct req/s':>14}")
    first = counts[0][1]
    for num_processes, suffix, cpus in counts:
        cells = []
        for label in ("gateway", "vllm-router"):
            rps = summary.get(label + suffix, {}).get("rps", float("nan"))
            base = summary.get(label + first, {}).get("rps", float("nan"))
            cells += [rps, rps / base]
        where = f"{num_processes} ({cpus or 'any'})"
        print(f"{where:<20}{cells[0]:>18,.0f}{cells[1]:>9.2f}{cells[2]:>19,.0f}"
              f"{cells[3]:>9.2f}{summary['direct']['rps']:>14,.0f}")


def _cells(values: tuple[float, ...]) -> str:
    return "".join(f"{v:>10.2f}" if i < 2 else f"{v:>11.2f}" for i, v in enumerate(values))




def tree_label(name: str) -> str:
    """The path of the gateway started from the checkout named `name` (`--gateway-tree name=DIR`)."""
    return f"gateway@{name}"


def print_tree_ratios(names: list[str], closed: dict[str, list[Round]],
                      opened: dict[float, dict[str, list[Round]]], summary: dict[str, dict[str, float]]) -> None:
    """Each tree after the first against the first: the ratio of the medians and, in brackets, the lowest and
    highest ratio of the same round's figures; then each tree's own spread between rounds."""
    if len(names) < 2:
        return
    first = tree_label(names[0])

    def figures(rounds: list[Round]) -> dict[str, list[float]]:
        return {"req/s": [r.result.num_ok / r.result.measured_s for r in rounds],
                "p50 ms": [percentile(r.result.total_ms, 0.5) for r in rounds],
                "CPU us/req": [r.cpu_us for r in rounds],
                "TTFT p50": [percentile(r.result.ttft_ms, 0.5) for r in rounds],
                "total p50": [percentile(r.result.total_ms, 0.5) for r in rounds]}

    phases = [("closed loop", closed, ("req/s", "p50 ms", "CPU us/req"))]
    phases += [(f"open loop {rate:.0f} rps", rounds, ("TTFT p50", "total p50", "CPU us/req"))
               for rate, rounds in opened.items()]
    print(f"\ntrees against {names[0]} (ratio of medians; in brackets the lowest and highest ratio within a round)")
    for name in names[1:]:
        label = tree_label(name)
        for phase, rounds, keys in phases:
            mine, base = figures(rounds[label]), figures(rounds[first])
            print(f"{name}/{names[0]} {phase}: " + ", ".join(ratio_cell(k, mine[k], base[k]) for k in keys))
        rss, rss_first = summary[label]["rss"], summary[first]["rss"]
        print(f"{name}/{names[0]} peak RSS {rss / rss_first:.3f} ({rss:.0f} MB / {rss_first:.0f} MB)", flush=True)
    print("spread between rounds, (highest - lowest) / median:")
    for name in names:
        label = tree_label(name)
        cells = [f"{phase} {k} {spread(figures(rounds[label])[k]):.0%}"
                 for phase, rounds, keys in phases for k in keys[:2]]
        print(f"  {name}: " + ", ".join(cells))
