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

Other checkouts (`--gateway-tree before=../old --gateway-tree after=.`, repeatable): each adds a path, gateway@NAME,
the gateway started with cwd=DIR (so that checkout's packages are imported; the same Python), interleaved with
the others; ratio lines give each tree against the first one named. `--paths direct` leaves only those.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# The processes started and the load sent live beside this script; this module measures and reports.
from bench_trees import check_trees, tree_option
from gateway_bench_load import (
    NUM_STREAM_TOKENS,
    PhaseResult,
    closed_loop,
    free_port,
    gateway_config,
    merge,
    open_loop,
    percentile,
    run_byte_relay,
    run_relay,
    run_upstream,
    wait_http,
)
from gateway_bench_report import _cells, median, print_scaling, print_summary, print_tree_ratios, tree_label

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
    parser.add_argument("--gateway-tree", type=tree_option, action="append", default=[], metavar="NAME=DIR",
                        help="one more path: the gateway run from the checkout DIR (its packages, this Python), "
                             "labelled gateway@NAME; repeatable; each after the first gets a ratio to the first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=pathlib.Path, metavar="PREFIX",
                        help="py-spy the gateway in each phase into PREFIX.<phase>.txt (raw stacks)")
    return parser.parse_args()


def _pinned(cpus: str | None, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def cpu_list(spec: str) -> list[str]:
    """A taskset list ("0-3", "0,2,5-6") as the CPUs it names, in order."""
    cpus: list[str] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus += [str(c) for c in range(int(first), int(last or first) + 1)]
    return cpus


def scaled(args: argparse.Namespace) -> list[tuple[int, str, str | None]]:
    """(processes, label suffix, CPUs) per --gateway-workers count: the first count keeps the plain labels
    (the summary against vllm-router reads them); with several counts, N processes get the first N CPUs."""
    counts = args.gateway_workers
    cpus = cpu_list(args.gateway_cpus) if args.gateway_cpus and len(counts) > 1 else None
    if cpus is not None and max(counts) > len(cpus):
        raise SystemExit(f"--gateway-cpus {args.gateway_cpus} has fewer CPUs than {max(counts)} processes")
    return [(n, "" if i == 0 else f"-x{n}", ",".join(cpus[:n]) if cpus else args.gateway_cpus)
            for i, n in enumerate(counts)]


def main() -> None:
    args = parse_args()
    if args.upstream is not None:
        run_upstream(args.upstream, args.token_interval_ms / 1e3)
        return
    if args.relay is not None:
        run_relay(args.relay, args.relay_to)
        return
    if args.relay_bytes is not None:
        run_byte_relay(args.relay_bytes, args.relay_to)
        return
    wanted = {"direct", *args.paths}
    if "vllm-router" in wanted and not args.vllm_router.exists():
        print(f"no baseline: {args.vllm_router} is missing (run `make bench-setup`)", flush=True)
        wanted.discard("vllm-router")
    check_trees(args.gateway_tree, "gateway")
    ROUTER_LOG.unlink(missing_ok=True)
    processes: list[subprocess.Popen] = []
    try:
        upstreams = start_upstreams(args, processes)
        paths = [BenchPath("direct", tuple(u + "/v1/chat/completions" for u in upstreams),
                           tuple(p.pid for p in processes))]
        starts = start_relays(args, wanted, upstreams)
        starts += start_gateways(args, wanted, upstreams, start_redis(args, wanted, processes))
        for label, process, url in starts:
            processes.append(process)
            # slow starts on a loaded box
            wait_http(url + ("/ready" if label.startswith("gateway") else "/health"), 180)
            paths.append(BenchPath(label, (url + "/v1/chat/completions",), process_tree(process.pid)))
        gateway_pid = next((p.pids[0] for p in paths if p.label == "gateway"), 0)
        run_phases(args, paths, Profiler(args.profile, gateway_pid, args.duration_s / args.rounds + args.warmup_s))
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


Start = tuple[str, subprocess.Popen, str]  # a path's label, its process and its base URL


def start_upstreams(args: argparse.Namespace, processes: list[subprocess.Popen]) -> list[str]:
    """The fake upstreams, healthy; their processes join `processes`."""
    upstreams = []
    for _ in range(args.num_upstreams):
        port = free_port()
        processes.append(subprocess.Popen(_pinned(args.upstream_cpus, [
            sys.executable, __file__, "--upstream", str(port),
            "--token-interval-ms", str(args.token_interval_ms)])))
        upstreams.append(f"http://127.0.0.1:{port}")
    for url in upstreams:
        wait_http(url + "/health", 20)
    return upstreams


def start_relays(args: argparse.Namespace, wanted: set[str], upstreams: list[str]) -> list[Start]:
    starts: list[Start] = []
    for relay in ("relay", "relay-bytes"):
        if relay in wanted:
            port = free_port()
            starts.append((relay, subprocess.Popen(_pinned(scaled(args)[0][2], [
                sys.executable, __file__, "--" + relay, str(port), "--relay-to", *upstreams])),
                f"http://127.0.0.1:{port}"))
    return starts


def start_redis(args: argparse.Namespace, wanted: set[str], processes: list[subprocess.Popen]) -> str | None:
    """A Redis for the gateways when they need one (--redis, or --workers N shares its state through it)."""
    gateways = {"gateway", "gateway-aiohttp"} & wanted or args.gateway_tree
    if not gateways or not (args.redis or max(args.gateway_workers) > 1):
        return None
    redis_port = free_port()
    processes.append(subprocess.Popen(_pinned(args.upstream_cpus, [
        "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no"]), stdout=subprocess.DEVNULL))
    return f"redis://127.0.0.1:{redis_port}/0"


def start_gateway(args: argparse.Namespace, port: int, upstreams: list[str], redis_url: str | None,
                  where: tuple[int, str | None, pathlib.Path], lean_http: bool = True) -> subprocess.Popen:
    """`python -m gateway.cli gateway` run in the checkout `where[2]` (its packages are the ones imported),
    with `where[0]` processes pinned to the CPUs `where[1]`."""
    num_processes, cpus, checkout = where
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as config:
        config.write(gateway_config(port, upstreams, args.policy, redis_url, lean_http=lean_http))
    return subprocess.Popen(_pinned(cpus, [
        sys.executable, "-m", "gateway.cli", "gateway", "--config", config.name,
        "--workers", str(num_processes)]), cwd=checkout)


def start_gateways(args: argparse.Namespace, wanted: set[str], upstreams: list[str],
                   redis_url: str | None) -> list[Start]:
    """This checkout's gateway (on its lean server and on aiohttp's) and vllm-router at each process count,
    then the gateway of each --gateway-tree at the first count."""
    starts: list[Start] = []
    for num_processes, suffix, cpus in scaled(args):
        for label in ("gateway", "gateway-aiohttp", "vllm-router"):  # gateway-aiohttp: on aiohttp's server
            if label not in wanted or (suffix and label == "gateway-aiohttp"):
                continue
            port = free_port()
            if label == "vllm-router":
                process = subprocess.Popen(_pinned(cpus, [
                    str(args.vllm_router), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                    *upstreams, "--policy", "round_robin", "--log-level", "warning",
                    "--prometheus-port", str(free_port())]),
                    stdout=subprocess.DEVNULL, stderr=ROUTER_LOG.open("ab"))
            else:
                process = start_gateway(args, port, upstreams, redis_url, (num_processes, cpus, ROOT),
                                        lean_http=label == "gateway")
            starts.append((label + suffix, process, f"http://127.0.0.1:{port}"))
    num_processes, _, cpus = scaled(args)[0]
    for name, checkout in args.gateway_tree:
        port = free_port()
        process = start_gateway(args, port, upstreams, redis_url, (num_processes, cpus, checkout))
        starts.append((tree_label(name), process, f"http://127.0.0.1:{port}"))
    return starts


VLLM_ROUTER = ROOT / ".venv-bench" / "bin" / "vllm-router"
ROUTER_LOG = pathlib.Path(tempfile.gettempdir()) / "gateway_bench.vllm-router.log"  # its stderr, for failures


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
        closed = closed_phase(pool, args, paths, profiler, summary)
        opened = {rate: open_phase(pool, args, paths, profiler, summary, rate) for rate in args.rates}
    for path in paths:
        summary[path.label]["rss"] = peak_rss_mb(path.pids)
    print_summary(summary, args.rates[-1] if args.rates else 0.0)
    if len(args.gateway_workers) > 1:
        print_scaling(summary, scaled(args))
    print_tree_ratios([name for name, _ in args.gateway_tree], closed, opened, summary)


def closed_phase(pool: ProcessPoolExecutor, args: argparse.Namespace, paths: list[BenchPath], profiler: Profiler,
                 summary: dict[str, dict[str, float]]) -> dict[str, list[Round]]:
    print(f"\nclosed loop, concurrency {args.concurrency}, non-streaming")
    print(f"{'path':<16}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'CPU us/req':>12}{'errors':>8}")
    closed = interleaved(paths, args, profiler, "closed", lambda path, d: run_closed(pool, list(path.urls), args, d))
    for label, rounds in closed.items():
        rps = median([r.result.num_ok / r.result.measured_s for r in rounds])
        cpu_us = median([r.cpu_us for r in rounds])
        summary[label].update(rps=rps, cpu_closed=cpu_us)
        print(f"{label:<16}{rps:>10.0f}{median([percentile(r.result.total_ms, 0.5) for r in rounds]):>9.2f}"
              f"{median([percentile(r.result.total_ms, 0.99) for r in rounds]):>9.2f}{cpu_us:>12.0f}"
              f"{sum(r.result.num_errors for r in rounds):>8}", flush=True)
    return closed


def open_phase(pool: ProcessPoolExecutor, args: argparse.Namespace, paths: list[BenchPath], profiler: Profiler,
               summary: dict[str, dict[str, float]], rate: float) -> dict[str, list[Round]]:
    print(f"\nopen loop, Poisson {rate:.0f} req/s, streaming {NUM_STREAM_TOKENS} tokens (ms)")
    print(f"{'path':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'total p50':>11}{'total p99':>11}"
          f"{'CPU us/req':>12}{'ok':>7}{'errors':>8}")
    opened = interleaved(paths, args, profiler, f"open{rate:.0f}", lambda path, d: pool.submit(
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
    return opened


if __name__ == "__main__":
    main()
