"""Instructions per request through the gateway, counted by valgrind: the instrument for changes of a few
percent on a shared machine. There CPU time per request moves by 10% from run to run, while the count of
instructions a request executes moves by less than 0.1% (two runs of the same checkout differed by 0.02%).

Runs `gateway_cpu_inprocess.py --bare-peers` (the real app in one process, with a client and an upstream that
write canned bytes) under `valgrind --tool=cachegrind --cache-sim=no`, at two request counts. Instructions per
request are the difference between the two totals over the difference in requests, so start-up and warm-up
cancel out. With `--baseline CHECKOUT` the same is done for another checkout (a `git worktree` of the commit
before), alternating, and the table gives the ratio.

    .venv/bin/python benchmarks/gateway_instructions.py [--baseline /tmp/ab-before] [--stream] [--repeat 2]

Instructions are not time: a change that saves instructions in code that stalls on memory or on the kernel
saves less time than its share, and system calls are not counted at all. Confirm a change with
`gateway_cpu_inprocess.py` or `gateway_bench.py` runs. Needs valgrind (`apt-get install valgrind`); each run
takes about a minute.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
INPROCESS = HERE / "gateway_cpu_inprocess.py"


def count(checkout: Path, num_requests: int, stream: bool, together: bool = False, access_log: bool = False) -> int:
    """Instructions that `gateway_cpu_inprocess.py --bare-peers` executes from `checkout`, start-up included."""
    with tempfile.TemporaryDirectory() as tmp:
        command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={tmp}/out",
                   sys.executable, str(INPROCESS), "--bare-peers", "--requests", str(num_requests)]
        if stream:
            command.append("--stream")
        if together:
            command.append("--events-together")
        if access_log:
            command += ["--access-log", f"{tmp}/access.jsonl"]
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(checkout)}
        done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"valgrind run failed in {checkout} ({done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip()[:72] or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with (e.g. a git worktree)")
    parser.add_argument("--stream", action="store_true", help="32-chunk SSE answers instead of whole ones")
    parser.add_argument("--events-together", action="store_true",
                        help="with --stream: each stream's events in one upstream write")
    parser.add_argument("--requests", type=int, nargs=2, default=(1000, 3000), metavar=("N1", "N2"),
                        help="the two request counts (multiples of 8, the in-process client's concurrency)")
    parser.add_argument("--repeat", type=int, default=1, help="measure each checkout this many times")
    parser.add_argument("--access-log", action="store_true",
                        help="instead of another checkout, this one without (the baseline) and with an access log")
    args = parser.parse_args()
    if args.events_together and not args.stream:
        parser.error("--events-together needs --stream")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    low, high = args.requests
    if high <= low:
        raise SystemExit("--requests N1 N2 needs N2 > N1")
    checkouts = {"this": HERE.parent}
    if args.baseline is not None:
        checkouts = {"baseline": args.baseline.resolve(), **checkouts}
    elif args.access_log:
        checkouts = {"baseline": HERE.parent, "this+log": HERE.parent}
    per_request: dict[str, list[float]] = {name: [] for name in checkouts}
    print(f"{'checkout':<9} {'round':>5} {'requests':>8} {'instructions':>16}")
    for round_index in range(args.repeat):
        totals: dict[str, dict[int, int]] = {name: {} for name in checkouts}
        for num_requests in (low, high):
            for name, checkout in checkouts.items():   # alternating, so a change in the machine hits both
                totals[name][num_requests] = count(checkout, num_requests, args.stream, args.events_together,
                                                   access_log=name == "this+log")
                print(f"{name:<9} {round_index:>5} {num_requests:>8} {totals[name][num_requests]:>16,}", flush=True)
        for name in checkouts:
            per_request[name].append((totals[name][high] - totals[name][low]) / (high - low))

    kind = "32-chunk streams" if args.stream else "whole answers"
    kind += ", events together" if args.events_together else ""
    print(f"\ninstructions per request ({kind}; client, gateway and upstream in one process):")
    print(f"{'checkout':<9} {'per request':>12} {'runs':<24} {'vs baseline':>11}  commit")
    base = per_request.get("baseline")
    for name, checkout in checkouts.items():
        runs = per_request[name]
        median = sorted(runs)[len(runs) // 2]
        ratio = f"{median / sorted(base)[len(base) // 2]:.3f}" if base else "-"
        listed = ", ".join(f"{r / 1000:.1f}k" for r in runs)
        print(f"{name:<9} {median / 1000:>11.1f}k {listed:<24} {ratio:>11}  {commit(checkout)}")


if __name__ == "__main__":
    main()
