"""`TieredKVConnector`: the KV tiers below the device pool (host RAM, local disk, a shared store) as a
`KVConnector` (backends/kv_connectors/base.py), keyed by the chained block hash.

Writing down: a cached block the device pool evicts is copied out (the engine thread, before the block
is reused) into one of a bounded set of staging buffers and queued for the writer thread, which puts it
in the first local tier; RAM spills what it evicts to disk. With a store, every newly cached block is
also queued for it, so another worker can use a prefix as soon as it is computed. When no staging
buffer is free the block is dropped: decode never waits on a tier.

Reading back: on a device miss, the scheduler asks for the leading run of the sequence's next blocks
held in any tier (in-memory indexes; the store answers one batched query). The sequence waits in
WAITING_FOR_REMOTE_KV while the loader thread copies each block from the fastest tier holding it:
straight from where host RAM keeps it, through a staging buffer from disk or the store. A block
missing or corrupt there ends the run, and the load reports only what it wrote: the rest is
recomputed. No step waits on I/O. On CUDA the copies out and in are queued and the threads wait for
them, not the engine (block_io.py); a load ends when its last copy has landed.

KV events: each tier's STORED and REMOVED carry its medium (backends/core/block_events.py).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from backends.core.block_events import KVEventKind, KVEventRing
from backends.core.outputs import KVTierLoad, LoadReport
from backends.core.sequence import Sequence as EngineSequence
from backends.kv_connectors.base import FinishedTransfers, LoadResult
from backends.kv_connectors.tiers.base import KVTier, TierUsage
from backends.kv_connectors.tiers.block_io import BlockIO, Pending, StagingRing

log = logging.getLogger(__name__)
PROBE_EVERY = 16     # a tier slower than computing is still read on one lookup in this many that it could serve


@dataclass(frozen=True, slots=True)
class _Load:
    request_id: str
    block_ids: tuple[int, ...]      # the sequence's blocks to fill, in order
    block_hashes: tuple[int, ...]   # what each must hold


class TieredKVConnector:
    def __init__(self, block_io: BlockIO, block_size: int, local: Sequence[KVTier], store: KVTier | None,
                 events: KVEventRing, write_queue_blocks: int = 64, read_slower_tiers: bool = False) -> None:
        if write_queue_blocks < 1:
            raise ValueError("write_queue_blocks must be at least 1")
        self.block_io = block_io
        self.block_size = block_size
        self.local = tuple(local)
        self.store = store
        self.tiers = (*self.local, *(() if store is None else (store,)))   # fastest first
        self.events = events
        self.wake: Callable[[], None] = lambda: None   # the engine thread's: a load ended
        # engine thread
        self._plans: dict[str, tuple[int, ...]] = {}
        self._new_loads: list[_Load] = []
        self._loading: set[str] = set()
        self._cancelled: set[str] = set()               # read by the loader thread
        # loader thread -> engine thread
        self._loaded: deque[LoadResult] = deque()
        # write-behind: staging buffers, at most write_queue_blocks in flight
        self._max_staging = write_queue_blocks
        self._num_staging = 0
        self._free_staging: deque[np.ndarray] = deque()
        self._writes: queue.SimpleQueue[tuple[KVTier, int, np.ndarray, Pending] | None] = queue.SimpleQueue()
        self._loads: queue.SimpleQueue[_Load | None] = queue.SimpleQueue()
        # counters (each written by one thread)
        self.restored: Counter[str] = Counter()   # blocks loaded back, by medium
        self.restore_seconds: dict[str, float] = defaultdict(float)   # time reading them back (read + copy)
        self.written: Counter[str] = Counter()    # blocks a tier took, by medium
        self.failed_writes: Counter[str] = Counter()   # blocks a tier did not take (full, I/O error, down)
        self.num_dropped_writes = 0               # evicted blocks not written down: no staging buffer free
        self.num_store_writes_skipped = 0         # engine thread: blocks not sent to the store while it was down
        self.num_load_errors = 0
        self._last_medium = ""                    # loader thread: the tier of the last block it restored
        # engine thread: a prompt token's compute as the engine last measured it (None: not yet; the
        # /load report's figure too), and the tiers slower than that
        self.compute_seconds_per_token: float | None = None
        self.skip_slower_tiers = not read_slower_tiers
        self._slower: set[str] = set()
        self.num_skipped = 0                      # lookups that passed a slower tier's blocks by
        self._threads = [threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True),
                         threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)]
        for thread in self._threads:
            thread.start()

    # --- BlockManager observer (engine thread) -----------------------------------------------------
    def block_evicted(self, block_id: int, block_hash: int) -> None:
        """The device pool is about to reuse a cached block: write it down unless a tier has it."""
        if self.local and not any(t.leading_hits((block_hash,)) for t in self.local):
            self._queue_write(self.local[0], block_id, block_hash)

    def block_cached(self, block_id: int, block_hash: int) -> None:
        """A block's KV was just computed (or restored) and cached: share it through the store. While the store
        is down the block is not copied out for a put that would fail: it counts as a write the store missed."""
        if self.store is None:
            return
        if not getattr(self.store, "is_up", True):
            self.num_store_writes_skipped += 1
            return
        self._queue_write(self.store, block_id, block_hash)

    def _queue_write(self, tier: KVTier, block_id: int, block_hash: int) -> None:
        try:
            buf = self._free_staging.popleft()
        except IndexError:
            if self._num_staging >= self._max_staging:
                self.num_dropped_writes += 1
                return
            buf = self.block_io.buffer()
            self._num_staging += 1
        self._writes.put((tier, block_hash, buf, self.block_io.read(block_id, buf)))

    # --- KVConnector, scheduler side (engine thread) ------------------------------------------------
    def get_num_new_matched_tokens(self, seq: EngineSequence, num_computed_tokens: int) -> int | None:
        if seq.kv_transfer is not None and seq.kv_transfer.remote is not None:
            return None                     # a decode leg: its prompt's KV comes from the prefill worker
        bs = self.block_size
        hashes = [seq.block_hash(i, bs) for i in range(num_computed_tokens // bs, (seq.num_tokens - 1) // bs)]
        slower = [t for t in self.tiers if self._slower_than_computing(t)]
        n = self._leading_run(hashes, slower)
        if slower and (n_all := self._leading_run(hashes, ())) > n:
            self.num_skipped += 1           # a tier slower than computing held more of the prefix
            if self.num_skipped % PROBE_EVERY == 0:
                n = n_all                   # read it anyway, now and then, so that its figure follows the machine
        if n == 0:
            return None
        self._plans[seq.request_id] = tuple(hashes[:n])
        return n * bs

    def set_wake(self, wake: Callable[[], None]) -> None:
        """How the loader thread gets the engine thread stepping when a load ends."""
        self.wake = wake

    def observe_compute(self, seconds_per_token: float | None) -> None:
        """The engine's latest fit of a prompt token's compute; None (no fit this step) keeps the last one."""
        if seconds_per_token:
            self.compute_seconds_per_token = seconds_per_token

    def _leading_run(self, hashes: list[int], without: Sequence[KVTier]) -> int:
        """How many of `hashes`, from the first, the tiers but `without` hold (the store only after RAM and disk)."""
        local = [t for t in self.local if t not in without]
        n = 0
        while n < len(hashes) and any(t.leading_hits((hashes[n],)) for t in local):
            n += 1
        if self.store is not None and self.store not in without and n < len(hashes):
            n += self.store.leading_hits(hashes[n:])
        return n

    def _slower_than_computing(self, tier: KVTier) -> bool:
        """Whether reading a token back from `tier` was measured to cost more than computing it (on a GPU a
        disk read can cost more than the prefill it saves); not yet measured: no."""
        fraction = self._restore_fraction(tier.medium, self.compute_seconds_per_token)
        slower = self.skip_slower_tiers and fraction is not None and fraction >= 1.0
        if slower != (tier.medium in self._slower):
            self._slower.symmetric_difference_update((tier.medium,))
            log.info("KV tier %s: reading a token back costs %s computing it; %s", tier.medium,
                     "an unknown share of" if fraction is None else f"{fraction:.2f}x",
                     f"read on 1 lookup in {PROBE_EVERY} it could serve" if slower else "read again")
        return slower

    def update_state_after_alloc(self, seq: EngineSequence, num_external_tokens: int) -> None:
        hashes = self._plans.pop(seq.request_id)
        first = seq.num_computed_tokens // self.block_size
        block_ids = tuple(seq.block_table[first:first + len(hashes)])
        self._new_loads.append(_Load(seq.request_id, block_ids, hashes))
        self._loading.add(seq.request_id)

    def request_finished(self, seq: EngineSequence) -> bool:
        request_id = seq.request_id
        if request_id not in self._loading:
            return False
        unstarted = [load for load in self._new_loads if load.request_id == request_id]
        if unstarted:                  # nothing writes its blocks yet: they may go at once
            self._new_loads.remove(unstarted[0])
            self._loading.discard(request_id)
            return False
        self._cancelled.add(request_id)
        return True

    # --- KVConnector, worker side (engine thread) ---------------------------------------------------
    def start_load_kv(self) -> None:
        for load in self._new_loads:
            self._loads.put(load)
        self._new_loads = []

    def get_finished(self) -> FinishedTransfers:
        loaded = [self._loaded.popleft() for _ in range(len(self._loaded))]
        for result in loaded:
            self._loading.discard(result.request_id)
            self._cancelled.discard(result.request_id)
        return FinishedTransfers((), tuple(loaded))

    # --- loader thread ------------------------------------------------------------------------------
    def _load_loop(self) -> None:
        staging = StagingRing(self.block_io)
        while (load := self._loads.get()) is not None:
            copies: list[tuple[Pending, Callable[[], None]]] = []
            num_blocks = 0
            try:
                num_blocks = self._load(load, staging, copies)
            except Exception:  # boundary: the blocks not written are recomputed; the worker goes on
                self.num_load_errors += 1
                log.exception("KV tier load for %s failed after %d blocks", load.request_id, len(copies))
            finally:
                started = time.perf_counter()
                for pending, release in copies:    # every copy landed before the sequence may run
                    self.block_io.wait(pending)
                    release()
                if num_blocks and copies:          # the copies' tail, counted with the last block's tier
                    self.restore_seconds[self._last_medium] += time.perf_counter() - started
            self._loaded.append(LoadResult(load.request_id, None, num_blocks * self.block_size))
            self.wake()

    def _load(self, load: _Load, staging: StagingRing, copies: list[tuple[Pending, Callable[[], None]]]) -> int:
        """Queue the copies of the load's blocks, in order, from the fastest tier holding each; the count
        queued. On CUDA they land after this returns: `copies` holds what to wait for and release."""
        self.block_io.begin_writes()
        for i, (block_id, block_hash) in enumerate(zip(load.block_ids, load.block_hashes, strict=True)):
            if load.request_id in self._cancelled:
                return i
            started = time.perf_counter()
            medium = self._copy_in(block_id, block_hash, staging, copies)
            if medium is None:
                return i
            self.restore_seconds[medium] += time.perf_counter() - started
            self.restored[medium] += 1
            self._last_medium = medium
        return len(load.block_ids)

    def _copy_in(self, block_id: int, block_hash: int, staging: StagingRing,
                 copies: list[tuple[Pending, Callable[[], None]]]) -> str | None:
        """Queue the copy of one block into `block_id` from the first tier holding it: straight from
        where a tier keeps it (RAM), or through a staging buffer; the tier's medium, None: none has it."""
        for tier in self.tiers:
            borrowed = tier.borrow(block_hash)
            if borrowed is not None:
                data, release = borrowed
                copies.append((self.block_io.write(block_id, data), release))
                return tier.medium
            buf = staging.take()
            if tier.get(block_hash, buf.data):
                pending = self.block_io.write(block_id, buf)
                staging.copying(pending)
                copies.append((pending, _nothing))
                return tier.medium
        return None

    # --- writer thread ------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            tier, block_hash, buf, pending = item
            try:
                self.block_io.wait(pending)         # the copy out of the device has landed
                if tier is not self.store or not tier.leading_hits((block_hash,)):
                    self._put(tier, block_hash, buf.data)
            except Exception:  # boundary: a failed write loses a cached block, nothing else
                self.failed_writes[tier.medium] += 1
                log.exception("KV tier %s: write of %016x failed", tier.medium, block_hash)
            finally:
                self._free_staging.append(buf)

    def _put(self, tier: KVTier, block_hash: int, data: memoryview) -> None:
        if not tier.put(block_hash, data):
            self.failed_writes[tier.medium] += 1
            return
        self.written[tier.medium] += 1
        self.events.append(KVEventKind.STORED, block_hash, None, self.block_size, tier.medium)

    # --- callbacks for the tiers (writer or loader thread) -------------------------------------------
    def spill_to(self, lower: KVTier) -> Callable[[int, memoryview], None]:
        """What a tier calls with a block it evicts: put it in `lower`."""
        return lambda block_hash, data: self._put(lower, block_hash, data)

    def removed_from(self, medium: str) -> Callable[[int], None]:
        """What a tier calls when it no longer holds a block: a REMOVED event."""
        return lambda block_hash: self.events.append(KVEventKind.REMOVED, block_hash, None, self.block_size, medium)

    # --- reporting and shutdown ---------------------------------------------------------------------
    def usage(self) -> tuple[TierUsage, ...]:
        return tuple(t.usage() for t in self.tiers)

    def load(self, seconds_per_token: float | None = None) -> tuple[KVTierLoad, ...]:
        """Each tier's figures; with `seconds_per_token` (the engine's measured compute of a prompt token),
        also what reading a token back from it costs against that, once it restored a block."""
        return tuple(KVTierLoad(u.medium, u.num_blocks, u.used_bytes, u.capacity_bytes, self.restored[u.medium],
                                self.written[u.medium], bool(getattr(t, "is_up", True)),
                                int(getattr(t, "num_outages", 0)), self.restore_seconds[u.medium],
                                self._restore_fraction(u.medium, seconds_per_token),
                                num_failed_writes=self._failed_writes(t), shared=getattr(t, "shared", ""))
                     for t, u in zip(self.tiers, self.usage(), strict=True))

    def add_to_report(self, report: LoadReport) -> LoadReport:
        """The tiers' part of the load report, read now (the writer and loader threads move blocks while the
        engine thread idles), priced against the engine's latest measure of a prompt token's compute."""
        per_token = self.compute_seconds_per_token   # read once: the restore costs are priced against it
        return dataclasses.replace(report, kv_tiers=self.load(per_token), seconds_per_prompt_token=per_token,
                                   num_kv_dropped_writes=self.num_dropped_writes)

    def _failed_writes(self, tier: KVTier) -> int:
        return self.failed_writes[tier.medium] + (self.num_store_writes_skipped if tier is self.store else 0)

    def _restore_fraction(self, medium: str, seconds_per_token: float | None) -> float | None:
        blocks = self.restored[medium]
        if not seconds_per_token or not blocks:
            return None
        return self.restore_seconds[medium] / (blocks * self.block_size) / seconds_per_token

    def close(self) -> None:
        """Stop both threads (pending writes are finished first) and close the tiers."""
        self._writes.put(None)
        self._loads.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        for tier in self.tiers:
            tier.close()


def _nothing() -> None:
    pass
