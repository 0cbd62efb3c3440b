"""An engine-thread `KVConnector` for tests: a decode leg (`kv_transfer.remote`) loads its prompt's
missing tokens, a prefill leg (`do_remote_decode`) that finishes by length keeps its blocks; loads
end and kept blocks go when the test says (`finish_load`, `release`), as the P/D connector's would."""
from __future__ import annotations

from backends.core.kv_transfer_params import KVTransferParams, RemoteBlocks
from backends.core.outputs import FinishReason
from backends.core.sequence import Sequence
from backends.kv_connectors.base import FinishedTransfers, LoadResult

REMOTE = KVTransferParams(remote=RemoteBlocks("127.0.0.1", 1, "t", None))   # a decode leg's params
PREFILL = KVTransferParams(do_remote_decode=True)                            # a prefill leg's


class FakeConnector:
    def __init__(self) -> None:
        self.loads: dict[str, Sequence] = {}     # loads in flight: request id -> sequence
        self.kept: dict[str, tuple[int, ...]] = {}   # finished prefill legs: request id -> kept blocks
        self.num_start_calls = 0
        self._sent: list[tuple[str, tuple[int, ...]]] = []    # released, not yet reported
        self._loaded: list[tuple[LoadResult, Sequence]] = []  # ended, not yet reported

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int | None:
        if seq.kv_transfer is None or seq.kv_transfer.remote is None:
            return None
        return max(0, seq.num_prompt_tokens - num_computed_tokens)

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        self.loads[seq.request_id] = seq

    def request_finished(self, seq: Sequence) -> bool:
        if seq.request_id in self.loads:
            return True
        if seq.kv_transfer is not None and seq.kv_transfer.do_remote_decode \
                and seq.finish_reason is FinishReason.LENGTH and seq.error is None:
            self.kept[seq.request_id] = tuple(seq.block_table)
            return True
        return False

    def start_load_kv(self) -> None:
        self.num_start_calls += 1

    def get_finished(self) -> FinishedTransfers:
        finished = FinishedTransfers(tuple(r for r, _ in self._sent), tuple(r for r, _ in self._loaded))
        self._sent, self._loaded = [], []
        return finished

    def block_owners(self) -> tuple[list[Sequence], list[tuple[int, ...]]]:
        """Sequences whose blocks a load may still write, and kept blocks, until the scheduler hears."""
        return [*self.loads.values(), *(seq for _, seq in self._loaded)], \
            [*self.kept.values(), *(blocks for _, blocks in self._sent)]

    # --- what the transfer would do ---------------------------------------------------------------
    def finish_load(self, request_id: str, error: str | None = None) -> bool:
        seq = self.loads.pop(request_id, None)
        if seq is None:
            return False
        self._loaded.append((LoadResult(request_id, error), seq))
        return True

    def release(self, request_id: str) -> bool:
        blocks = self.kept.pop(request_id, None)
        if blocks is None:
            return False
        self._sent.append((request_id, blocks))
        return True
