"""The interface the scheduler consults about KV that lives outside the device pool (as vLLM v1's
`KVConnectorBase_V1`): tokens a connector can load, the load's outcome, and blocks to keep when a
sequence finishes. Prefill-to-decode transfer is one connector (pd_connector.py); the KV tiers keyed
by `Sequence.block_hash` (tiers/connector.py) are another; `MultiConnector` (multi.py) consults
several. No torch, no sockets here.

Beside `KVConnector`, small optional protocols for what only some connectors do; the engine checks
for them once, when it is built: `BlockObserver` (backends/core/block_manager.py: told of cached and
evicted blocks), `ComputeObserver`, `WakeTarget`, `LoadContributor`, `Closeable`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from backends.core.block_manager import BlockObserver
from backends.core.outputs import LoadReport
from backends.core.sequence import Sequence

__all__ = ["BlockObserver", "Closeable", "ComputeObserver", "FinishedTransfers", "KVConnector", "LoadContributor",
           "LoadResult", "WakeTarget"]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """An asynchronous load that ended, successfully or not (the connector to the engine thread)."""
    request_id: str          # the sequence whose blocks were written
    error: str | None        # None: the load succeeded (see num_tokens); else why not (the sequence fails)
    num_tokens: int | None = None   # a cache tier's load: the leading tokens it wrote, the rest are recomputed
                                    # (prefix hits); None: a transfer that wrote every external token


@dataclass(frozen=True, slots=True)
class FinishedTransfers:
    """What a connector finished since its last report (vLLM: finished_sending / finished_recving)."""
    sent: tuple[str, ...] = ()              # finished sequences whose kept blocks the connector no longer needs
    loaded: tuple[LoadResult, ...] = ()     # sequences whose load ended: they may run (or fail)


class KVConnector(Protocol):
    """Consulted by `Scheduler` in the engine thread; a connector does its I/O elsewhere and reports
    back through `get_finished`. A sequence waits for a load in `SequenceStatus.WAITING_FOR_REMOTE_KV`."""

    # --- scheduler side: bookkeeping only, during schedule() and finish() --------------------------
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int | None:
        """Tokens past the `num_computed_tokens` found in the local prefix cache whose KV this
        connector will load asynchronously; None when it loads nothing for seq (0: a load that
        copies nothing but must still run, e.g. to release a remote hold)."""
        ...

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """seq now has blocks for all its tokens; record the load that fills them."""
        ...

    def request_finished(self, seq: Sequence) -> bool:
        """seq has finished (its finish_reason and error are set; its blocks are still in
        `block_table`). True: do not free its blocks yet; they go once `get_finished` names seq,
        in `sent` (kept for a transfer) or in `loaded` (a load into them was still running)."""
        ...

    # --- worker side: I/O ---------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Start the loads recorded since the last call (called once per engine step)."""
        ...

    def get_finished(self) -> FinishedTransfers:
        """Transfers that ended since the last call (called at the start of each engine step)."""
        ...


# --- optional: what only some connectors do (the engine looks for each once) ------------------------

@runtime_checkable
class ComputeObserver(Protocol):
    """Told the engine's latest fit of a prompt token's compute after each step that ran the model (the
    tiers price their reads against it)."""

    def observe_compute(self, seconds_per_token: float | None) -> None:
        """None: no fit this step (keep the last one)."""
        ...


@runtime_checkable
class WakeTarget(Protocol):
    """Does I/O on its own thread and must get the engine thread stepping when a load ends. (The P/D
    connector is handed its wake on the event loop, with its transport: `PDConnector.attach`.)"""

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake` may be called from any thread; set once, before the first step."""
        ...


@runtime_checkable
class LoadContributor(Protocol):
    """Has figures of its own for the load report (GET /load, /metrics)."""

    def add_to_report(self, report: LoadReport) -> LoadReport:
        """`report` with this connector's fields filled in, read now (any thread)."""
        ...


@runtime_checkable
class Closeable(Protocol):
    """Owns threads or files that must be stopped when the engine stops stepping (engine thread)."""

    def close(self) -> None:
        ...
