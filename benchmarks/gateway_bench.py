"""Gateway overhead benchmark: the same load sent straight to a fast fake upstream and through the
gateway, side by side in one run. Closed loop (max requests/s at a fixed concurrency, non-streaming)
and open loop (Poisson arrivals at fixed rates, streaming 32 tokens: TTFT and total latency).

Starts everything itself: fake upstream processes (aiohttp, a fixed completion), the gateway
(`python -m gateway.cli gateway --config <tmp yaml>`) and load-generator processes.

    .venv/bin/python benchmarks/gateway_bench.py [--duration-s 12] [--rounds 4] [--gateway-workers 2]

The baseline is vLLM's Rust router (`vllm-router`, round robin) from .venv-bench (`make bench-setup`),
measured in the same run, interleaved with the other paths; every figure is a median over the rounds.

Scaling across cores (`--gateway-workers 1 2 4 --gateway-cpus 0-3`): each count is a path of its own in the
same interleaved run, the gateway with N processes pinned to the first N of the gateway CPUs, and vllm-router
pinned to the same N CPUs beside it; a last table gives each one's req/s against its own at the first count.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# The processes started (gateway_bench_start.py) and the load sent (gateway_bench_load.py) live beside this
# script; this module measures and reports.
from gateway_bench_load import (
    NUM_STREAM_TOKENS,
    PhaseResult,
    closed_loop,
    open_loop,
    percentile,
    run_byte_relay,
    run_relay,
    run_upstream,
    wait_http,
)
from gateway_bench_start import (
    ROUTER_LOG,
    scaled,
    start_redis,
    start_relays,
    start_routers,
    start_upstreams,
    stop_all,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


# --- orchestration -------------------------------------------------------------------------------

def run_closed(pool: ProcessPoolExecutor, urls: list[str], args: argparse.Namespace,
               duration_s: float) -> PhaseResult:
    """Split the concurrency over the client processes and merge their results."""
    n = args.client_procs
    shares = [args.concurrency // n + (i < args.concurrency % n) for i in range(n)]
    futures = [pool.submit(closed_loop, urls[i % len(urls):] + urls[:i % len(urls)], share, args.warmup_s,
                           duration_s, False) for i, share in enumerate(shares)]
    merged = merge([f.result() for f in futures])
    return PhaseResult(merged.num_ok, merged.num_errors, duration_s, merged.ttft_ms, merged.total_ms)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)  # internal: serve a fake upstream
    parser.add_argument("--relay", type=int, help=argparse.SUPPRESS)     # internal: serve the bare relay
    parser.add_argument("--relay-bytes", type=int, help=argparse.SUPPRESS)  # internal: serve the byte relay
    parser.add_argument("--relay-to", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--num-upstreams", type=int, default=2)
    parser.add_argument("--token-interval-ms", type=float, default=0.0, help="fake upstream delay per token")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--rates", type=float, nargs="*", default=[200.0],
                        help="open-loop rates (none: closed loop only)")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="per round")
    parser.add_argument("--duration-s", type=float, default=12.0, help="measured, per phase and path")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per phase")
    parser.add_argument("--policy", default="round_robin", help="the gateway's (vllm-router: round_robin)")
    parser.add_argument("--gateway-workers", type=int, nargs="+", default=[1], metavar="N",
                        help="switchyard gateway --workers N; several counts: a path each (scaling)")
    parser.add_argument("--redis", action="store_true", help="give the gateway a Redis store (always with "
                        "--gateway-workers > 1), started here on the upstreams' cpus")
    parser.add_argument("--vllm-router", type=pathlib.Path, default=VLLM_ROUTER,
                        help="the baseline's launcher (`make bench-setup` installs it); absent: no baseline")
    parser.add_argument("--paths", nargs="+", default=["direct", "relay", "gateway", "vllm-router"],
                        help="which paths to measure (direct is always measured: the added TTFT needs it); "
                             "gateway-aiohttp: the gateway with `listen.lean_http: false`; "
                             "relay-bytes: bytes passed through on uvloop protocols, a Python relay's floor")
    parser.add_argument("--upstream-cpus", help="taskset CPU list for the fake upstreams (e.g. 1)")
    parser.add_argument("--gateway-cpus", help="taskset CPU list for the gateway and vllm-router (e.g. 0); with "
                        "several --gateway-workers counts, a path of N processes gets the list's first N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=pathlib.Path, metavar="PREFIX",
                        help="py-spy the gateway in each phase into PREFIX.<phase>.txt (raw stacks)")
    return parser.parse_args()


def run_helper_role(args: argparse.Namespace) -> bool:
    """This script started as one of its own helper processes (an upstream or a relay): run it; False if not."""
    if args.upstream is not None:
        run_upstream(args.upstream, args.token_interval_ms / 1e3)
    elif args.relay is not None:
        run_relay(args.relay, args.relay_to)
    elif args.relay_bytes is not None:
        run_byte_relay(args.relay_bytes, args.relay_to)
    else:
        return False
    return True


def main() -> None:
    args = parse_args()
    if run_helper_role(args):
        return
    wanted = {"direct", *args.paths}
    if "vllm-router" in wanted and not args.vllm_router.exists():
        print(f"no baseline: {args.vllm_router} is missing (run `make bench-setup`)", flush=True)
        wanted.discard("vllm-router")
    ROUTER_LOG.unlink(missing_ok=True)
    processes: list[subprocess.Popen] = []
    try:
        upstreams = start_upstreams(args, processes)
        paths = [BenchPath("direct", tuple(u + "/v1/chat/completions" for u in upstreams),
                           tuple(p.pid for p in processes))]
        starts = start_relays(args, wanted, upstreams)
        redis_url = start_redis(args, wanted, processes)
        starts += start_routers(args, wanted, upstreams, redis_url)
        for label, process, url in starts:
            processes.append(process)
            # slow starts on a loaded box
            wait_http(url + ("/ready" if label.startswith("gateway") else "/health"), 180)
            paths.append(BenchPath(label, (url + "/v1/chat/completions",), process_tree(process.pid)))
        gateway_pid = next((p.pids[0] for p in paths if p.label == "gateway"), 0)
        run_phases(args, paths, Profiler(args.profile, gateway_pid, args.duration_s / args.rounds + args.warmup_s))
    finally:
        stop_all(processes)


VLLM_ROUTER = ROOT / ".venv-bench" / "bin" / "vllm-router"


@dataclass(frozen=True, slots=True)
class BenchPath:
    label: str                       # direct, relay, relay-bytes, gateway or vllm-router
    urls: tuple[str, ...]            # where the load generator sends
    pids: tuple[int, ...]            # the processes whose CPU time and memory are charged to this path


def process_tree(pid: int) -> tuple[int, ...]:
    """`pid` and its descendants (a gateway with --workers N is N + 1 processes)."""
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for task in pathlib.Path(f"/proc/{parent}/task").iterdir():
            children = (task / "children").read_text().split()
            pids += map(int, children)
            frontier += map(int, children)
    return tuple(pids)


def cpu_s(pids: tuple[int, ...]) -> float:
    """User + system CPU seconds used so far by `pids` (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pids: tuple[int, ...]) -> float:
    """The sum of the processes' peak resident sizes (VmHWM) in MB."""
    total_kb = 0
    for pid in pids:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024


class Profiler:
    """py-spy (installed beside this Python) recording the gateway for one phase, when asked."""

    def __init__(self, prefix: pathlib.Path | None, pid: int, duration_s: float) -> None:
        self._prefix, self._pid, self._duration_s = prefix, pid, duration_s
        self._process: subprocess.Popen | None = None

    def start(self, phase: str) -> None:
        if self._prefix is None:
            return
        py_spy = pathlib.Path(sys.executable).with_name("py-spy")
        self._process = subprocess.Popen(
            [str(py_spy), "record", "--pid", str(self._pid), "--format", "raw", "--rate", "250",
             "--duration", str(int(self._duration_s)), "--nonblocking",
             "--output", f"{self._prefix}.{phase}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self._process is not None:
            self._process.wait()
            self._process = None


def merge(parts: list[PhaseResult]) -> PhaseResult:
    return PhaseResult(sum(p.num_ok for p in parts), sum(p.num_errors for p in parts),
                       sum(p.measured_s for p in parts), sum((p.ttft_ms for p in parts), ()),
                       sum((p.total_ms for p in parts), ()))


@dataclass(frozen=True, slots=True)
class Round:
    result: PhaseResult              # one path's load in one round
    cpu_us: float                    # its processes' CPU µs per completed request in that round


def interleaved(paths: list[BenchPath], args: argparse.Namespace, profiler: Profiler, phase: str,
                run_one: Callable[[BenchPath, float], PhaseResult]) -> dict[str, list[Round]]:
    """Run a phase in `args.rounds` short rounds, rotating the paths' order, so that load drift on a
    shared machine falls on every path alike. Returns each path's rounds (medians are taken over them)."""
    rounds: dict[str, list[Round]] = {p.label: [] for p in paths}
    for k in range(args.rounds):
        for path in paths[k % len(paths):] + paths[:k % len(paths)]:
            if path.label == "gateway" and k == 0:
                profiler.start(phase)
            before = cpu_s(path.pids)
            result = run_one(path, args.duration_s / args.rounds)
            rounds[path.label].append(Round(result, (cpu_s(path.pids) - before) / max(1, result.num_ok) * 1e6))
            profiler.stop()
    return rounds


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return (ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2) if ordered else float("nan")


def run_phases(args: argparse.Namespace, paths: list[BenchPath], profiler: Profiler) -> None:
    print(f"fake upstreams: {args.num_upstreams} (token interval {args.token_interval_ms} ms, cpus "
          f"{args.upstream_cpus or 'any'}); gateway policy {args.policy}, "
          f"{'/'.join(map(str, args.gateway_workers))} process(es), "
          f"cpus {args.gateway_cpus or 'any'}; {args.client_procs} client procs; cpus {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.1f}; {args.duration_s:.0f} s per phase and path in "
          f"{args.rounds} interleaved rounds, each after {args.warmup_s:.1f} s warm-up; figures are medians "
          f"over the rounds. CPU us/req: the upstreams' for direct, the path's own processes for the others",
          flush=True)
    summary: dict[str, dict[str, float]] = {p.label: {} for p in paths}
    with ProcessPoolExecutor(max_workers=args.client_procs) as pool:
        for path in paths:  # warm every path, its connection pools and the client processes
            pool.submit(closed_loop, list(path.urls), 4, 0.0, 0.5, True).result()
        print(f"\nclosed loop, concurrency {args.concurrency}, non-streaming")
        print(f"{'path':<16}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'CPU us/req':>12}{'errors':>8}")
        closed = interleaved(paths, args, profiler, "closed",
                             lambda path, d: run_closed(pool, list(path.urls), args, d))
        for label, rounds in closed.items():
            rps = median([r.result.num_ok / r.result.measured_s for r in rounds])
            cpu_us = median([r.cpu_us for r in rounds])
            summary[label].update(rps=rps, cpu_closed=cpu_us)
            print(f"{label:<16}{rps:>10.0f}{median([percentile(r.result.total_ms, 0.5) for r in rounds]):>9.2f}"
                  f"{median([percentile(r.result.total_ms, 0.99) for r in rounds]):>9.2f}{cpu_us:>12.0f}"
                  f"{sum(r.result.num_errors for r in rounds):>8}", flush=True)
        for rate in args.rates:
            print(f"\nopen loop, Poisson {rate:.0f} req/s, streaming {NUM_STREAM_TOKENS} tokens (ms)")
            print(f"{'path':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'total p50':>11}{'total p99':>11}"
                  f"{'CPU us/req':>12}{'ok':>7}{'errors':>8}")
            opened = interleaved(paths, args, profiler, f"open{rate:.0f}", lambda path, d, rate=rate: pool.submit(
                open_loop, list(path.urls), rate, args.warmup_s, d, True, args.seed).result())
            rows = {}
            for label, rounds in opened.items():
                rows[label] = tuple(median([percentile(getattr(r.result, field), q) for r in rounds])
                                    for field, q in (("ttft_ms", 0.5), ("ttft_ms", 0.99),
                                                     ("total_ms", 0.5), ("total_ms", 0.99)))
                cpu_us = median([r.cpu_us for r in rounds])
                summary[label][f"cpu_stream{rate:.0f}"] = cpu_us
                print(f"{label:<16}" + _cells(rows[label]) + f"{cpu_us:>12.0f}"
                      f"{sum(r.result.num_ok for r in rounds):>7}{sum(r.result.num_errors for r in rounds):>8}")
            for label in rows:
                if label != "direct":
                    added = tuple(v - d for v, d in zip(rows[label], rows["direct"], strict=True))
                    summary[label].update({f"ttft50_{rate:.0f}": added[0], f"ttft99_{rate:.0f}": added[1]})
                    print(f"{'+' + label:<16}" + _cells(added), flush=True)
    for path in paths:
        summary[path.label]["rss"] = peak_rss_mb(path.pids)
    print_summary(summary, args.rates[-1] if args.rates else 0.0)
    if len(args.gateway_workers) > 1:
        print_scaling(summary, scaled(args))


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


if __name__ == "__main__":
    main()
