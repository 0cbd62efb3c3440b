"""How the gateway benchmark (gateway_bench.py) starts its processes and stops them: the fake upstreams, the
relays, a Redis, the routers under test (our gateway, vllm-router), each pinned to its CPUs with taskset."""
from __future__ import annotations

import argparse
import pathlib
import signal
import subprocess
import sys
import tempfile

from gateway_bench_load import free_port, gateway_config, wait_http

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH_SCRIPT = pathlib.Path(__file__).resolve().with_name("gateway_bench.py")  # its helper roles: --upstream, --relay
ROUTER_LOG = pathlib.Path(tempfile.gettempdir()) / "gateway_bench.vllm-router.log"  # its stderr, for failures


def pinned(cpus: str | None, cmd: list[str]) -> list[str]:
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


def start_upstreams(args: argparse.Namespace, processes: list[subprocess.Popen]) -> list[str]:
    """The fake upstreams, started, waited for and appended to `processes`; their base URLs."""
    upstreams = []
    for _ in range(args.num_upstreams):
        port = free_port()
        processes.append(subprocess.Popen(pinned(args.upstream_cpus, [
            sys.executable, str(BENCH_SCRIPT), "--upstream", str(port),
            "--token-interval-ms", str(args.token_interval_ms)])))
        upstreams.append(f"http://127.0.0.1:{port}")
    for url in upstreams:
        wait_http(url + "/health", 20)
    return upstreams


def start_relays(args: argparse.Namespace, wanted: set[str],
                 upstreams: list[str]) -> list[tuple[str, subprocess.Popen, str]]:
    """The plain relays asked for, as (label, process, base URL), not yet waited for."""
    starts: list[tuple[str, subprocess.Popen, str]] = []
    for relay in ("relay", "relay-bytes"):
        if relay in wanted:
            port = free_port()
            starts.append((relay, subprocess.Popen(pinned(scaled(args)[0][2], [
                sys.executable, str(BENCH_SCRIPT), "--" + relay, str(port), "--relay-to", *upstreams])),
                f"http://127.0.0.1:{port}"))
    return starts


def start_redis(args: argparse.Namespace, wanted: set[str], processes: list[subprocess.Popen]) -> str | None:
    """A Redis for gateways that share state (--redis, or --workers N), appended to `processes`; its URL."""
    if not ({"gateway", "gateway-aiohttp"} & wanted and (args.redis or max(args.gateway_workers) > 1)):
        return None
    redis_port = free_port()  # --workers N shares its state through Redis
    processes.append(subprocess.Popen(pinned(args.upstream_cpus, [
        "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no"]), stdout=subprocess.DEVNULL))
    return f"redis://127.0.0.1:{redis_port}/0"


def start_router(args: argparse.Namespace, label: str, port: int, num_processes: int, cpus: str | None,
                 upstreams: list[str], redis_url: str | None) -> subprocess.Popen:
    """One router under test: vllm-router, or our gateway (lean HTTP client, or aiohttp's)."""
    if label == "vllm-router":
        return subprocess.Popen(pinned(cpus, [
            str(args.vllm_router), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
            *upstreams, "--policy", "round_robin", "--log-level", "warning",
            "--prometheus-port", str(free_port())]),
            stdout=subprocess.DEVNULL, stderr=ROUTER_LOG.open("ab"))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as config:
        config.write(gateway_config(port, upstreams, args.policy, redis_url,
                                    lean_http=label == "gateway"))
    return subprocess.Popen(pinned(cpus, [
        sys.executable, "-m", "gateway.cli", "gateway", "--config", config.name,
        "--workers", str(num_processes)]), cwd=ROOT)


def start_routers(args: argparse.Namespace, wanted: set[str], upstreams: list[str],
                  redis_url: str | None) -> list[tuple[str, subprocess.Popen, str]]:
    """Every router asked for, at each --gateway-workers count, as (label, process, base URL)."""
    starts: list[tuple[str, subprocess.Popen, str]] = []
    for num_processes, suffix, cpus in scaled(args):
        for label in ("gateway", "gateway-aiohttp", "vllm-router"):  # gateway-aiohttp: on aiohttp's server
            if label not in wanted or (suffix and label == "gateway-aiohttp"):
                continue
            port = free_port()
            process = start_router(args, label, port, num_processes, cpus, upstreams, redis_url)
            starts.append((label + suffix, process, f"http://127.0.0.1:{port}"))
    return starts


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
