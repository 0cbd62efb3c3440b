"""`ConnectorChain`: several KV connectors behind the scheduler's one (a worker serves disaggregated
legs and has KV tiers). The first connector that loads a sequence owns that load; a finished
sequence's blocks are kept if any connector keeps them (at most one does: only a connector that is
loading into them, or one holding a finished prefill leg, which never loaded)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from backends.kv_connectors.base import FinishedTransfers, KVConnector

if TYPE_CHECKING:
    from backends.core.sequence import Sequence


class ConnectorChain:
    def __init__(self, *connectors: KVConnector) -> None:
        self.connectors = connectors
        self._owners: dict[str, KVConnector] = {}

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
