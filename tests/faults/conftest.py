"""Fixtures of the fault-injection suite: fake upstream and gateway processes that live for a whole module
(each test scripts its fault per request, or says which process it breaks), stopped at the module's end."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess


class Processes:
    """Starts fakes and gateways for one module and stops them all at its end."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._fakes: list[FakeUpstream] = []
        self._gateways: list[GatewayProcess] = []

    def fakes(self, *names: str, behaviour: dict[str, Any] | None = None) -> list[FakeUpstream]:
        fakes = [FakeUpstream(name, behaviour, wait=False) for name in names]
        self._fakes.extend(fakes)
        for fake in fakes:
            fake.wait_ready()
        return fakes

    def gateway(self, config: dict[str, Any], **kwargs: Any) -> GatewayProcess:
        gateway = GatewayProcess(config, self._workdir, **kwargs)
        self._gateways.append(gateway)
        return gateway

    def stop(self) -> None:
        for gateway in self._gateways:
            gateway.stop()
        for fake in self._fakes:
            fake.stop()


def num_seen(fake: FakeUpstream, request_id: str) -> int:
    """How many times `fake` received the request with this x-request-id."""
    return int(fake.stats()["request_ids"].count(request_id))


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    processes = Processes(tmp_path_factory.mktemp("faults"))
    try:
        yield processes
    finally:
        processes.stop()
