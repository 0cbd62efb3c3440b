"""The host-RAM tier: a pool of block-sized slots in one buffer (pinned on a CUDA worker; on a CPU
worker, simply a second, larger pool), LRU by use. A block it evicts is first handed to `spill`
(the next tier down), then forgotten.

Threads: `put` runs only in the writer thread, so a slot leaves the index before it is reused and
no reader can find it; `get` and `borrow` pin the slot until its copy is done, and eviction skips
pinned slots.
"""
from __future__ import annotations

import functools
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from backends.core.block_events import CPU
from backends.kv_connectors.tiers.base import Borrowed, TierUsage, leading_run

Spill = Callable[[int, memoryview], object]     # (block hash, its bytes): write it one tier down
Removed = Callable[[int], None]                 # a block hash this tier no longer holds


class CpuTier:
    medium = CPU

    def __init__(self, capacity_bytes: int, block_nbytes: int, pinned: bool = False,
                 spill: Spill | None = None, removed: Removed | None = None) -> None:
        num_slots = capacity_bytes // block_nbytes
        if num_slots < 1:
            raise ValueError(f"--kv-cpu-gb holds no block of {block_nbytes} bytes")
        self.block_nbytes = block_nbytes
        self.spill = spill
        self.removed = removed
        self._pool = torch.empty((num_slots, block_nbytes), dtype=torch.uint8, pin_memory=pinned).numpy()
        self._index: OrderedDict[int, int] = OrderedDict()   # block hash -> slot, least recent first
        self._free = list(range(num_slots))
        self._pins: Counter[int] = Counter()
        self._lock = threading.Lock()
        self.num_hits = self.num_puts = 0

    @property
    def num_slots(self) -> int:
        return len(self._pool)

    def leading_hits(self, block_hashes: Sequence[int]) -> int:
        with self._lock:
            return leading_run(self._index, block_hashes)

    def get(self, block_hash: int, out: memoryview) -> bool:
        borrowed = self.borrow(block_hash)
        if borrowed is None:
            return False
        data, release = borrowed
        try:
            np.frombuffer(out, dtype=np.uint8)[:] = data
        finally:
            release()
        return True

    def borrow(self, block_hash: int) -> Borrowed | None:
        """The block's slot (pinned memory on a CUDA worker), kept from reuse until `release`."""
        with self._lock:
            slot = self._index.get(block_hash)
            if slot is None:
                return None
            self._index.move_to_end(block_hash)
            self._pins[slot] += 1
        self.num_hits += 1
        return self._pool[slot], functools.partial(self._unpin, slot)

    def _unpin(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] -= 1

    def put(self, block_hash: int, data: memoryview) -> bool:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
        slot = self._take_slot()
        if slot is None:
            return False
        self._pool[slot] = np.frombuffer(data, dtype=np.uint8)
        with self._lock:
            self._index[block_hash] = slot
        self.num_puts += 1
        return True

    def _take_slot(self) -> int | None:
        """A free slot, or the least recently used unpinned one once its block is spilled: it stays
        findable here until the tier below has it, so a lookup never falls between the two."""
        while True:
            with self._lock:
                if self._free:
                    return self._free.pop()
                victim = next((h for h, s in self._index.items() if not self._pins[s]), None)
                if victim is None:
                    return None
                slot = self._index[victim]
            if self.spill is not None:
                self.spill(victim, memoryview(self._pool[slot]))   # only this thread writes slots
            with self._lock:
                if self._pins[slot]:
                    continue            # a reader took it meanwhile: choose again (it is spilled already)
                del self._index[victim]
            if self.removed is not None:
                self.removed(victim)
            return slot

    def usage(self) -> TierUsage:
        with self._lock:
            n = len(self._index)
        return TierUsage(CPU, n, n * self.block_nbytes, self.num_slots * self.block_nbytes)

    def close(self) -> None:
        pass
