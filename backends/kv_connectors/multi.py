"""`MultiConnector`: several KV connectors behind the scheduler's one, in the order the configuration
names them (as vLLM's MultiConnector composes them: a worker serves disaggregated legs and has KV tiers).
The first connector that loads a sequence owns that load; a finished sequence's blocks are kept if any
connector keeps them (at most one does: only a connector that is loading into them, or one holding a
finished prefill leg, which never loaded). The optional parts of the interface go to the connectors
that have them, in order. `find_connector` is the one typed lookup of a connector by class."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from backends.kv_connectors.base import (
    BlockObserver,
    Closeable,
    ComputeObserver,
    FinishedTransfers,
    KVConnector,
    LoadContributor,
    WakeTarget,
)

if TYPE_CHECKING:
    from backends.core.outputs import LoadReport
    from backends.core.sequence import Sequence

C = TypeVar("C")


class MultiConnector:
    def __init__(self, *connectors: KVConnector) -> None:
        self.connectors = connectors
        self._owners: dict[str, KVConnector] = {}
        self._block_observers = [c for c in connectors if isinstance(c, BlockObserver)]
        self._compute_observers = [c for c in connectors if isinstance(c, ComputeObserver)]
        self._load_contributors = [c for c in connectors if isinstance(c, LoadContributor)]

    # --- KVConnector -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int | None:
        for connector in self.connectors:
            n = connector.get_num_new_matched_tokens(seq, num_computed_tokens)
            if n is not None:
                self._owners[seq.request_id] = connector
                return n
        return None

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        self._owners.pop(seq.request_id).update_state_after_alloc(seq, num_external_tokens)

    def request_finished(self, seq: Sequence) -> bool:
        return any(connector.request_finished(seq) for connector in self.connectors)

    def start_load_kv(self) -> None:
        for connector in self.connectors:
            connector.start_load_kv()

    def get_finished(self) -> FinishedTransfers:
        reports = [connector.get_finished() for connector in self.connectors]
        return FinishedTransfers(tuple(r for f in reports for r in f.sent),
                                 tuple(r for f in reports for r in f.loaded))

    # --- the optional parts, to those that have them -------------------------------------------------
    def block_cached(self, block_id: int, block_hash: int) -> None:
        for observer in self._block_observers:
            observer.block_cached(block_id, block_hash)

    def block_evicted(self, block_id: int, block_hash: int) -> None:
        for observer in self._block_observers:
            observer.block_evicted(block_id, block_hash)

    def observe_compute(self, seconds_per_token: float | None) -> None:
        for observer in self._compute_observers:
            observer.observe_compute(seconds_per_token)

    def set_wake(self, wake: Callable[[], None]) -> None:
        for connector in self.connectors:
            if isinstance(connector, WakeTarget):
                connector.set_wake(wake)

    def add_to_report(self, report: LoadReport) -> LoadReport:
        for contributor in self._load_contributors:
            report = contributor.add_to_report(report)
        return report

    def close(self) -> None:
        for connector in self.connectors:
            if isinstance(connector, Closeable):
                connector.close()

    def find(self, kind: type[C]) -> C | None:
        return next((c for c in self.connectors if isinstance(c, kind)), None)


def find_connector(connector: KVConnector | None, kind: type[C]) -> C | None:
    """The connector of class `kind`: `connector` itself, or one of a MultiConnector's; None if none is."""
    if isinstance(connector, MultiConnector):
        return connector.find(kind)
    return connector if isinstance(connector, kind) else None
