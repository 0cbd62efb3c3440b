"""The test suite's port picker never hands out a port the kernel could give a port-0 bind or an outgoing
connection (a worker's KV listener once took another worker's HTTP port between pick and bind), nor one
port twice."""
from __future__ import annotations

import socket

import pytest

from tests.support import ports
from tests.support.ports import (
    _EPHEMERAL_RANGE_PATH,
    CLUSTER_BUS_OFFSET,
    _candidate_range,
    free_cluster_port,
    free_port,
)


def test_ports_lie_outside_the_ephemeral_range_and_repeat_never() -> None:
    first, last = (int(part) for part in _EPHEMERAL_RANGE_PATH.read_text().split())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not first <= port <= last for port in ports)


def test_a_port_another_process_listens_on_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    low, _ = _candidate_range()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        for held in range(low + 500, low + 1500):       # a port in the range that nothing here handed out
            try:
                listener.bind(("127.0.0.1", held))
                break
            except OSError:
                continue
        listener.listen()
        draws = iter([held, held, low + 1700, low + 1701, low + 1702])
        monkeypatch.setattr(ports.random, "randint", lambda _low, _high: next(draws))
        assert free_port() in {low + 1700, low + 1701, low + 1702}


def test_cluster_ports_leave_room_for_their_bus_ports() -> None:
    """A Redis Cluster node also listens on its port + 10000: both lie outside the ephemeral range, and a bus
    port is never another node's port."""
    low, high = _candidate_range()
    picked = [free_cluster_port() for _ in range(12)]
    taken = set(picked) | {port + CLUSTER_BUS_OFFSET for port in picked}
    assert len(taken) == 24
    assert all(low <= port and port + CLUSTER_BUS_OFFSET <= min(high, 65_535) for port in picked)
    assert free_port() not in taken
