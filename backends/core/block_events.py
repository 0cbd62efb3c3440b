"""KV cache events (block stored / removed) in a bounded, thread-safe ring.

The gateway's prefix index follows these by sequence number; a consumer that fell off the ring
is told to resync (`reset`). Owns no blocks: the block manager appends, the server reads.
"""
from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass


class KVEventKind(str, enum.Enum):
    STORED = "stored"    # a full block became reusable under its hash
    REMOVED = "removed"  # a cached block was evicted; its hash is no longer served


# Where a block's KV lies (vLLM's `medium`): the device pool, or a tier behind the KV connector.
DEVICE, CPU, DISK, STORE = "device", "cpu", "disk", "store"
MEDIA = (DEVICE, CPU, DISK, STORE)   # fastest first


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq_no: int                 # monotonically increasing from 1, per engine
    kind: KVEventKind           # stored or removed
    block_hash: int             # chained hash (cache.block_hash) of the block
    parent_hash: int | None     # hash of the previous block (ROOT_HASH for a first block); None on REMOVED
    num_tokens: int             # tokens in the block (always block_size for stored blocks)
    medium: str = DEVICE        # where the block is (or was) stored: one of MEDIA


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    events: tuple[KVEvent, ...]  # events with seq_no > since, oldest first
    next_since: int              # pass this as `since` next time
    reset: bool                  # True: events were lost since `since`; rebuild the index from scratch


class KVEventRing:
    """Bounded FIFO of KV events; appends from the engine thread, reads from any thread."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._last_seq_no = 0
        self._lock = threading.Lock()

    @property
    def last_seq_no(self) -> int:
        return self._last_seq_no

    def append(self, kind: KVEventKind, block_hash: int, parent_hash: int | None, num_tokens: int,
               medium: str = DEVICE) -> None:
        with self._lock:
            self._last_seq_no += 1
            self._events.append(KVEvent(self._last_seq_no, kind, block_hash, parent_hash, num_tokens, medium))

    def since(self, since: int, limit: int = 1000) -> KVEventBatch:
        with self._lock:
            oldest = self._events[0].seq_no if self._events else self._last_seq_no + 1
            reset = since < oldest - 1 or since > self._last_seq_no
            start = oldest if reset else since + 1
            skip = start - oldest
            picked = tuple(self._events[i] for i in range(skip, min(len(self._events), skip + max(0, limit))))
            next_since = picked[-1].seq_no if picked else (start - 1)
            return KVEventBatch(picked, next_since, reset)
