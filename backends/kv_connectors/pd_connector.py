"""`PDConnector`: disaggregated prefill/decode as a `KVConnector` (docs/disaggregation.md). A prefill
leg's blocks are kept under its request id (the transfer id) until a decode worker releases them or
a timer expires them; a decode leg's prompt KV is pulled into its blocks over a `KVTransport`.

Scheduler-side methods run in the engine thread and only record; the holds, their timers, the
readers pinning blocks and the pulls live on the event loop. News crosses back through deques
that `get_finished` drains, and `wake` gets the engine thread stepping.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.core.block_events import KVEventRing
from backends.core.engine_config import EngineConfig
from backends.core.kv_transfer_params import RemoteBlocks
from backends.core.outputs import FinishReason
from backends.core.sequence import Sequence as EngineSequence
from backends.kv_connectors.base import FinishedTransfers, LoadResult
from backends.kv_transfer.base import KVBlockSink, KVErrorCode, KVTransferError, KVTransport

__all__ = ["KVHold", "PDConnector", "build_pd_connector"]
log = logging.getLogger(__name__)
_MAX_KEPT_ERRORS = 1024     # pull errors nobody asked for (the client left) are dropped past this
_MAX_DEBUG_RECORDS = 256
# Refusals that no decode worker would get past (another layout or weights, another block count): the gateway
# does not ask for the hold again (it runs the request whole on a decode worker), so it is released at once,
# not left to expire. Halfway through a rolling upgrade every such request would otherwise pin its prompt's
# blocks on the prefill worker for the hold timeout.
_HOLD_USELESS = (KVErrorCode.LAYOUT_MISMATCH, KVErrorCode.BAD_REQUEST)


@dataclass(frozen=True, slots=True)
class KVHold:
    request_id: str              # the finished prefill sequence (its id is the transfer id)
    block_ids: tuple[int, ...]   # kept blocks, in sequence order, covering the prompt
    num_tokens: int              # prompt tokens whose KV the blocks hold


@dataclass(frozen=True, slots=True)
class _Load:
    request_id: str              # the decode leg's sequence
    remote: RemoteBlocks         # where the prefill worker holds the prompt's KV
    block_ids: tuple[int, ...]   # local destination blocks (those not already in the prefix cache)
    start_block: int             # leading prompt blocks found locally: not pulled


def build_pd_connector(config: EngineConfig, kv_cache: Any, weights_fingerprint: str,
                       events: KVEventRing) -> PDConnector:
    """The registry's factory (registry.py). The transport, the cache's blocks and the wake come later, on
    the event loop (`attach`): the server owns the listener."""
    return PDConnector(config.kv_hold_timeout_s)


class PDConnector:
    def __init__(self, hold_timeout_s: float = 30.0) -> None:
        self.hold_timeout_s = hold_timeout_s
        # engine thread
        self._new_loads: list[_Load] = []
        self._loading: set[str] = set()       # recorded loads not yet reported back by get_finished
        # event loop -> engine thread
        self._sent: deque[str] = deque()
        self._loaded: deque[LoadResult] = deque()
        # event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: KVTransport | None = None
        self._sink: KVBlockSink | None = None
        self._block_size = 0
        self._wake: Callable[[], None] = lambda: None
        self._digest: Callable[[Sequence[int]], list[str]] | None = None
        self._holds: dict[str, tuple[KVHold, asyncio.TimerHandle]] = {}   # transfer id -> hold, expiry
        self._draining: list[KVHold] = []     # released while a reader still had their blocks
        self._pins: Counter[int] = Counter()  # block id -> open readers
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._releases: set[asyncio.Task[None]] = set()   # release_refused's messages in flight
        self._errors: OrderedDict[str, KVTransferError] = OrderedDict()
        self.received: OrderedDict[str, dict[str, object]] = OrderedDict()   # debug: digests of pulled blocks
        self.totals: dict[str, float] = {"pulls": 0, "bytes": 0, "seconds": 0.0, "shared_memory_pulls": 0,
                                             "cuda_ipc_pulls": 0}

    def attach(self, transport: KVTransport, sink: KVBlockSink, wake: Callable[[], None],
               digest: Callable[[Sequence[int]], list[str]] | None = None) -> None:
        """Event loop, once the engine runs: where pulls go and land, and how to wake the engine.
        `digest` (debug only) records per-block digests of what each pull wrote."""
        self._loop = asyncio.get_running_loop()
        self._transport, self._sink, self._wake, self._digest = transport, sink, wake, digest
        self._block_size = sink.layout().block_size

    async def detach(self) -> None:
        """Event loop, once the worker stops: holds and pulls end (attach's pair)."""
        for _, timer in self._holds.values():
            timer.cancel()
        self._holds.clear()
        pulls = list(self._pulls.values())
        for task in pulls:
            task.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)

    # --- KVConnector, scheduler side (engine thread) -----------------------------------------------
    def get_num_new_matched_tokens(self, seq: EngineSequence, num_computed_tokens: int) -> int | None:
        if seq.kv_transfer is None or seq.kv_transfer.remote is None:
            return None
        return max(0, seq.num_prompt_tokens - num_computed_tokens)

    def update_state_after_alloc(self, seq: EngineSequence, num_external_tokens: int) -> None:
        assert seq.kv_transfer is not None and seq.kv_transfer.remote is not None
        num_prompt_blocks = -(-seq.num_prompt_tokens // self._block_size)
        start = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self._block_size
        self._new_loads.append(_Load(seq.request_id, seq.kv_transfer.remote,
                                     tuple(seq.block_table[start:num_prompt_blocks]), start))
        self._loading.add(seq.request_id)

    def request_finished(self, seq: EngineSequence) -> bool:
        request_id = seq.request_id
        if request_id in self._loading:
            unstarted = [load for load in self._new_loads if load.request_id == request_id]
            if unstarted:              # nothing writes its blocks yet: they may go at once
                self._new_loads.remove(unstarted[0])
                self._loading.discard(request_id)
                return False
            self._call_in_loop(self._cancel_pull, request_id)
            return True
        # Only a prefill leg that stopped because its one token is out hands its KV on; an
        # EOS/stop token (reason STOP), an abort or an error frees it.
        if seq.kv_transfer is None or not seq.kv_transfer.do_remote_decode or self._loop is None \
                or seq.finish_reason is not FinishReason.LENGTH or seq.error is not None:
            return False
        hold = KVHold(request_id, tuple(seq.block_table), seq.num_prompt_tokens)
        self._call_in_loop(self._add_hold, hold)   # before the sequence's final output is delivered
        return True

    # --- KVConnector, worker side (engine thread) ---------------------------------------------------
    def start_load_kv(self) -> None:
        if self._new_loads:
            loads, self._new_loads = self._new_loads, []
            self._call_in_loop(self._start_pulls, loads)

    def get_finished(self) -> FinishedTransfers:
        sent = [self._sent.popleft() for _ in range(len(self._sent))]
        loaded = [self._loaded.popleft() for _ in range(len(self._loaded))]
        for result in loaded:
            self._loading.discard(result.request_id)
        return FinishedTransfers(tuple(sent), tuple(loaded))

    def _call_in_loop(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None, "PDConnector.attach() has not run"
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the loop is closed: the worker is going away
            log.debug("event loop closed; dropped %s", fn)

    # --- decode legs: pulls (event loop) ------------------------------------------------------------
    def _start_pulls(self, loads: list[_Load]) -> None:
        for load in loads:
            self._pulls[load.request_id] = asyncio.get_running_loop().create_task(self._pull(load))

    def _cancel_pull(self, request_id: str) -> None:
        task = self._pulls.get(request_id)
        if task is not None:
            task.cancel()

    async def _pull(self, load: _Load) -> None:
        """Fill the blocks, or fail; either way report the load as over (and never before the
        transport stopped writing: a cancelled shared-memory copy is waited for inside pull)."""
        assert self._transport is not None and self._sink is not None
        remote = load.remote
        error: str | None = "KV load cancelled"
        try:
            if load.block_ids:
                result = await self._transport.pull(remote, self._sink, load.block_ids, load.start_block)
                t = self.totals
                t.update(pulls=t["pulls"] + 1, bytes=t["bytes"] + result.num_bytes,
                         seconds=t["seconds"] + result.elapsed_s,
                         shared_memory_pulls=t["shared_memory_pulls"] + result.shared_memory,
                         cuda_ipc_pulls=t["cuda_ipc_pulls"] + result.cuda_ipc)
            else:   # every prompt block was in our prefix cache: only the release is left
                await self._transport.release(remote)
            if self._digest is not None:
                self.received[remote.transfer_id] = {"start_block": load.start_block,
                                                     "digests": self._digest(load.block_ids)}
                while len(self.received) > _MAX_DEBUG_RECORDS:
                    self.received.popitem(last=False)
            error = None
        except KVTransferError as exc:
            log.warning("KV pull of %s from %s:%d failed: %s", remote.transfer_id, remote.host, remote.port, exc)
            self._errors[load.request_id] = exc
            while len(self._errors) > _MAX_KEPT_ERRORS:
                self._errors.popitem(last=False)
            error = f"KV transfer failed: {exc}"
            if exc.code in _HOLD_USELESS:
                await self._release_useless(remote)
        except Exception as exc:  # boundary: a background task; its sequence fails, the worker goes on
            log.exception("KV pull of %s failed", remote.transfer_id)
            error = f"KV transfer failed: {exc!r}"
        finally:
            self._pulls.pop(load.request_id, None)
            self._loaded.append(LoadResult(load.request_id, error))
            self._wake()

    async def _release_useless(self, remote: RemoteBlocks) -> None:
        assert self._transport is not None
        try:
            await self._transport.release(remote)
        except KVTransferError as exc:   # it expires on its own
            log.info("could not release the refused KV hold %s: %s", remote.transfer_id, exc)

    def release_refused(self, remote: RemoteBlocks) -> None:
        """Event loop: a decode leg this worker refused before its pull (its body does not fit this worker, or
        does not match the held prompt): no decode leg will ask for that hold, so the prefill worker is told to
        release it now rather than keep the prompt's blocks until it expires."""
        task = asyncio.get_running_loop().create_task(self._release_useless(remote))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def take_load_error(self, request_id: str) -> KVTransferError | None:
        """Why the pull for `request_id` failed, once (the decode leg maps it to an HTTP answer)."""
        return self._errors.pop(request_id, None)

    # --- prefill legs: holds (event loop) -----------------------------------------------------------
    def _add_hold(self, hold: KVHold) -> None:
        timer = asyncio.get_running_loop().call_later(self.hold_timeout_s, self._expire, hold.request_id)
        self._holds[hold.request_id] = (hold, timer)

    def hold(self, transfer_id: str) -> KVHold | None:
        entry = self._holds.get(transfer_id)
        return None if entry is None else entry[0]

    def lookup(self, transfer_id: str) -> Sequence[int] | None:
        entry = self._holds.get(transfer_id)
        return None if entry is None else entry[0].block_ids

    def release_transfer(self, transfer_id: str) -> bool:
        """Drop a hold (decode worker's RELEASE, expiry, or no decode leg coming); False if unknown.
        Blocks a reader is still sending are freed once it closes."""
        entry = self._holds.pop(transfer_id, None)
        if entry is None:
            return False
        hold, timer = entry
        timer.cancel()
        self._draining.append(hold)
        self._release_drained()
        return True

    def pin(self, block_ids: Sequence[int]) -> None:
        self._pins.update(block_ids)

    def unpin(self, block_ids: Sequence[int]) -> None:
        self._pins.subtract(block_ids)
        self._release_drained()

    def _release_drained(self) -> None:
        still = []
        for hold in self._draining:
            if any(self._pins[b] > 0 for b in hold.block_ids):
                still.append(hold)
            else:
                self._sent.append(hold.request_id)
                self._wake()
        self._draining = still

    def _expire(self, transfer_id: str) -> None:
        if self.release_transfer(transfer_id):
            log.info("KV hold %s expired unclaimed after %.1f s", transfer_id, self.hold_timeout_s)
