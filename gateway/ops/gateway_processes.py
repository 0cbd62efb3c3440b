"""`switchyard gateway --workers N`: N gateway processes on one port. Each binds it with SO_REUSEPORT
and the kernel spreads new connections among them; they share sessions, rate limits, usage, breaker
states and in-flight leases through the state store, so N > 1 needs `redis_url` (an in-process store
would give each process its own limits and sessions).

This parent only supervises: it starts the processes, forwards SIGTERM/SIGINT so each one drains, restarts
a process that dies while serving, and exits once all have ended. It never touches a request.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger(__name__)

MAX_AUTO_WORKERS = 4      # `auto` stops here: past a few processes the upstreams, not the gateway, bound a host
EARLY_EXIT_S = 5.0        # a process that dies this soon after starting is a setup error (port, config): stop all
RESTART_DELAY_S = 1.0     # before restarting a process that died while serving
POLL_S = 0.2              # how often the parent looks at its children


class WorkersError(Exception):
    """A `--workers` value this config cannot run."""


def resolve_workers(requested: int | None, redis_url: str | None) -> int:
    """The number of processes to run: `requested`, or when None the cores (at most MAX_AUTO_WORKERS)
    with a Redis store and 1 without. Raises `WorkersError` for N > 1 without Redis."""
    if requested is None:
        return min(os.cpu_count() or 1, MAX_AUTO_WORKERS) if redis_url else 1
    if requested < 1:
        raise WorkersError(f"--workers must be at least 1, got {requested}")
    if requested > 1 and not redis_url:
        raise WorkersError(f"--workers {requested} needs `redis_url` in the config: processes share sessions, "
                           "rate limits, usage and in-flight load through Redis (the in-process store is per process)")
    return requested


@dataclass(slots=True)
class _Child:
    index: int                        # which of the N (for logs)
    process: subprocess.Popen[bytes]  # the gateway process
    started_s: float                  # time.monotonic() at its start


def run_workers(config_path: str, num_workers: int, drain_timeout_s: float) -> int:
    """Run `num_workers` gateway processes until SIGTERM/SIGINT; returns the exit code."""
    command = [sys.executable, "-m", "gateway.cli", "gateway", "--config", config_path, "--reuse-port"]
    stopping = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    def start(index: int) -> _Child:
        return _Child(index, subprocess.Popen(command), time.monotonic())

    children = [start(i) for i in range(num_workers)]
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda *_: _forward(children, signal.SIGHUP))   # each reloads its keys
    log.warning("switchyard gateway: %d processes (pids %s) on one port", num_workers,
                ", ".join(str(c.process.pid) for c in children))
    while not stopping:
        time.sleep(POLL_S)
        for i, child in enumerate(children):
            code = child.process.poll()
            if code is None or stopping:
                continue
            if time.monotonic() - child.started_s < EARLY_EXIT_S:
                log.error("gateway process %d exited with %d at start-up; stopping all", child.index, code)
                on_signal(signal.SIGTERM, None)
                _wait_all(children, drain_timeout_s)
                return 1
            log.error("gateway process %d (pid %d) exited with %d; restarting it", child.index,
                      child.process.pid, code)
            time.sleep(RESTART_DELAY_S)
            children[i] = start(child.index)
    return _wait_all(children, drain_timeout_s)


def _forward(children: list[_Child], signum: int) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signum)


def _wait_all(children: list[_Child], drain_timeout_s: float) -> int:
    """Wait for every process to drain and exit (killed past the drain time and a margin)."""
    deadline = time.monotonic() + drain_timeout_s + 15.0
    worst = 0
    for child in children:
        try:
            code = child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            code = child.process.wait()
        worst = worst or (code if code > 0 else 0)
    return worst
