"""CPU a gateway process spends with no requests at all: its background work (health polls, lease and
routing sharing through Redis, sweeps), which every request pays for at a low request rate (at 200
requests/s, 10 ms of background CPU a second is 50 µs a request).

Starts fake upstreams, a Redis server (`--redis`) and the gateway from this checkout and, with `--baseline
PATH`, from another checkout (before a change), alternating, and prints CPU ms per second for each:

    .venv/bin/python benchmarks/gateway_idle_cpu.py --redis --num-upstreams 4 --baseline /tmp/before
"""
from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from gateway_bench import cpu_s, median
from gateway_bench_load import closed_loop, free_port, gateway_config, wait_http

HERE = pathlib.Path(__file__).resolve().parent


def idle_cpu_ms_per_s(root: pathlib.Path, upstreams: list[str], redis_url: str | None, seconds: float) -> float:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as config:
        config.write(gateway_config(port, upstreams, "round_robin", redis_url))
    gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--config", config.name], cwd=root,
                               stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", 60)
        closed_loop([f"http://127.0.0.1:{port}/v1/chat/completions"], 4, 0.0, 1.0, True)  # warm every path
        time.sleep(2.0)   # start-up work (the routed log's history, first polls) is over
        before = cpu_s((gateway.pid,))
        time.sleep(seconds)
        return (cpu_s((gateway.pid,)) - before) / seconds * 1e3
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(10)
        os.unlink(config.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=pathlib.Path, help="another checkout, measured in the same run")
    parser.add_argument("--num-upstreams", type=int, default=2)
    parser.add_argument("--redis", action="store_true", help="give the gateway a Redis store")
    parser.add_argument("--seconds", type=float, default=10.0, help="idle time measured per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of this checkout and the baseline")
    args = parser.parse_args()
    checkouts = {"this checkout": HERE.parent}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    processes, upstreams = [], []
    try:
        for _ in range(args.num_upstreams):
            port = free_port()
            upstream = [sys.executable, str(HERE / "gateway_bench.py"), "--upstream", str(port)]
            processes.append(subprocess.Popen(upstream))
            upstreams.append(f"http://127.0.0.1:{port}")
        redis_url = None
        if args.redis:
            port = free_port()
            processes.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save",
                                               "", "--appendonly", "no"], stdout=subprocess.DEVNULL))
            redis_url = f"redis://127.0.0.1:{port}/0"
        for url in upstreams:
            wait_http(url + "/health", 20)
        results: dict[str, list[float]] = {label: [] for label in checkouts}
        for _ in range(args.rounds):
            for label, root in checkouts.items():
                results[label].append(idle_cpu_ms_per_s(root, upstreams, redis_url, args.seconds))
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
            process.wait(10)
    print(f"idle gateway CPU, ms per second: {args.num_upstreams} upstreams, Redis {'on' if args.redis else 'off'}, "
          f"{args.seconds:.0f} s per run, {args.rounds} alternating runs, median")
    for label, values in results.items():
        print(f"{label:<16}{median(values):>8.1f}   runs: {', '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
