"""Shares in-flight load between gateway processes (`--workers N`, and replicas on other hosts) through
the state store: every `interval_s` each process publishes its own leases per endpoint and reads back
the sum of the other processes' (`LoadTracker.set_peer_load`). Routing never waits for it: a policy
sees its own leases exactly and the peers' as of the last read (at most `interval_s` old).

Why not only the workers' `/load` reports: not every engine offers one (a fake, a hosted API, vLLM's
/metrics has no token counts), and a report is a poll interval old for *all* load, ours included.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable

from gateway.routing.load import LoadTracker
from gateway.routing.periodic import Periodic
from gateway.state import StateStore


def replica_id() -> str:
    """This process's name in the store: host, pid and a random part (pids repeat across hosts)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


class LoadSharer(Periodic):
    """The background task that publishes this process's leases and reads the peers'."""

    def __init__(self, tracker: LoadTracker, store: StateStore, endpoint_ids: Callable[[], Iterable[str]],
                 interval_s: float) -> None:
        super().__init__(interval_s)
        self._tracker = tracker
        self._store = store
        self._endpoint_ids = endpoint_ids
        self._ttl_s = max(1.0, 4 * interval_s)  # a process that stops publishing drops out after this
        self.replica_id = replica_id()

    async def share_once(self) -> None:
        """Publish our leases at every endpoint and read the peers' sums back, in one store call."""
        endpoint_ids = list(self._endpoint_ids())
        peers = await self._store.share_inflight(
            self.replica_id, {e: self._tracker.local_snapshot(e) for e in endpoint_ids}, self._ttl_s)
        for endpoint_id in endpoint_ids:
            num_requests, num_prefill, num_decode = [*peers.get(endpoint_id, ()), 0, 0, 0][:3]
            self._tracker.set_peer_load(endpoint_id, num_requests, num_prefill, num_decode)
