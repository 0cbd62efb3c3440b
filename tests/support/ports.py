"""The one free-port picker of the test suite (and of the benchmarks that start servers).

Ports come from outside the kernel's ephemeral range, so nothing that binds port 0 (a worker's KV-transfer
listener, redis' or a test's own listeners) and no outgoing connection can take a port handed out here before
the server it was picked for binds it: five workers started at once each picking a port, then each binding an
ephemeral KV listener, once had one worker's KV listener sit on the next worker's HTTP port. A port is handed
out at most once per process.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE_PATH = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000                 # below: well-known and registered services' usual ports
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1, outside the ephemeral range, free a moment ago and never returned before."""
    low, high = _candidate_range()
    if high - low < 1000:                              # an ephemeral range that leaves no room: the OS picks
        return _os_picked_port()
    for _ in range(1000):
        port = random.randint(low, high)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {low}-{high} after 1000 tries")


def _candidate_range() -> tuple[int, int]:
    """The widest stretch of [10000, 65535] that the kernel never hands out for port 0."""
    try:
        first, last = (int(part) for part in _EPHEMERAL_RANGE_PATH.read_text().split())
    except (OSError, ValueError):
        first, last = 32_768, 60_999                   # Linux's default
    below = (_LOWEST, first - 1)
    above = (last + 1, 65_535)
    return max(below, above, key=lambda span: span[1] - span[0])


def _os_picked_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


CLUSTER_BUS_OFFSET = 10_000      # a Redis Cluster node also listens on its port + 10000 (the cluster bus)


def free_cluster_port() -> int:
    """A port for a Redis Cluster node: it and its bus port (+10000) both outside the ephemeral range, free a
    moment ago, never handed out before, and the bus port still a valid port (so the port is below 55536)."""
    low, high = _candidate_range()
    high = min(high - CLUSTER_BUS_OFFSET, 65_535 - CLUSTER_BUS_OFFSET)
    if high - low < 100:
        raise RuntimeError(f"no room for a port and its bus port (+{CLUSTER_BUS_OFFSET}) outside the ephemeral range")
    for _ in range(1000):
        port = random.randint(low, high)
        bus = port + CLUSTER_BUS_OFFSET
        if {port, bus}.isdisjoint(_handed_out) and _bindable(port) and _bindable(bus):
            _handed_out.update((port, bus))
            return port
    raise RuntimeError(f"no free port pair in {low}-{high} after 1000 tries")
