"""Shares the approximate prefix index between gateway processes (`--workers N`, and replicas on other
hosts) through the state store. An endpoint without KV events is indexed from the prompts the gateway
routed there (`PrefixIndex.record_routed`); split over N processes, each would see 1/N of the routing and a
conversation's next turn would mostly reach a process that never routed it (benchmarks/routing_sim.py:
69% of precise's hit rate at 2 processes, 56% at 4; shared, 99% and 100%). So every process appends its
decisions to a shared log every `interval_s` and applies its peers' to its own index.

Routing never waits for it: a process sees its own decisions at once and its peers' within about two
intervals. The log is a Redis stream capped at `MAX_LOG_BATCHES` batches; a process that starts reads back
the last `HISTORY_S` of it, so a restart comes back with a warm index. A store outage loses decisions (the
index is an estimate), never a request.
"""
from __future__ import annotations

import base64
import logging
import struct
import time
from collections.abc import Callable, Sequence

import orjson

from cache.prefix_index import PrefixIndex
from gateway.routing.load_share import replica_id
from gateway.routing.periodic import Periodic
from gateway.state import StateStore

log = logging.getLogger(__name__)

MAX_LOG_BATCHES = 512      # batches the shared log keeps (one per process per interval)
READ_BATCHES = 64          # batches read per call
HISTORY_S = 600.0          # a starting process applies the decisions of the last this many seconds
MAX_PENDING = 10_000       # decisions held for the next publish; beyond (a long outage) the oldest go


def encode(decisions: Sequence[tuple[str, Sequence[int]]]) -> str:
    """[[endpoint id, base64 of the little-endian uint64 block hashes], ...] as JSON."""
    return orjson.dumps([[endpoint_id, base64.b64encode(struct.pack(f"<{len(hashes)}Q", *hashes)).decode()]
                         for endpoint_id, hashes in decisions]).decode()


def decode(payload: str) -> list[tuple[str, tuple[int, ...]]]:
    """`encode`'s decisions; ValueError (or a subclass) on a malformed payload."""
    data = orjson.loads(payload)
    if not isinstance(data, list):
        raise ValueError("shared routing decisions must be a list")
    decisions = []
    for endpoint_id, packed in data:
        raw = base64.b64decode(packed, validate=True)
        decisions.append((str(endpoint_id), struct.unpack(f"<{len(raw) // 8}Q", raw)))
    return decisions


class PrefixSharer(Periodic):
    """The background task that publishes this process's routing decisions and applies its peers'."""

    def __init__(self, index: PrefixIndex, store: StateStore, interval_s: float,
                 on_applied: Callable[[int], None] = lambda num_decisions: None) -> None:
        super().__init__(interval_s)
        self._index = index
        self._on_applied = on_applied   # peers' decisions applied (a metric)
        self._store = store
        self._pending: list[tuple[str, Sequence[int]]] = []
        self._cursor = f"{max(0, time.time_ns() // 1_000_000 - int(HISTORY_S * 1000))}-0"
        self.replica_id = replica_id()

    def note(self, endpoint_id: str, block_hashes: Sequence[int]) -> None:
        """A prompt with these blocks was routed to approximate `endpoint_id` (Legs.choose)."""
        self._pending.append((endpoint_id, block_hashes))
        if len(self._pending) > MAX_PENDING:
            del self._pending[:len(self._pending) - MAX_PENDING]

    async def share_once(self) -> None:
        """Publish the decisions made since the last call, then apply every peer batch appended since."""
        if self._pending:
            batch, self._pending = self._pending, []
            await self._store.publish_routed(self.replica_id, encode(batch), MAX_LOG_BATCHES)
        while True:
            self._cursor, entries = await self._store.read_routed(self._cursor, READ_BATCHES)
            for replica, payload in entries:
                if replica != self.replica_id:
                    self._apply(payload)
            if len(entries) < READ_BATCHES:
                return

    def _apply(self, payload: str) -> None:
        try:
            decisions = decode(payload)
        except (ValueError, TypeError, struct.error) as exc:
            log.warning("skipping a malformed batch of shared routing decisions: %r", exc)
            return
        for endpoint_id, block_hashes in decisions:
            self._index.record_routed(endpoint_id, block_hashes)  # a no-op for endpoints not approximate here
        self._on_applied(len(decisions))
