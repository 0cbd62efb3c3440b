"""A worker's KV events as the gateway reads them (`GET /kv_events`): the wire records and the media a
block can lie in. The worker's side is backends/core/block_events.py; tests/cache/test_prefix_index.py
holds the two to the same fields and media. Pure parsing: no I/O, no index.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

# Where a block's KV lies, fastest first: the names of the worker's backends/core/block_events.MEDIA
# (tests/cache/test_prefix_index.py holds the two equal).
DEVICE, CPU, DISK, STORE = "device", "cpu", "disk", "store"
MEDIA = (DEVICE, CPU, DISK, STORE)
MEDIUM_BITS = {medium: 1 << i for i, medium in enumerate(MEDIA)}  # medium -> its bit in a set of media


class KvEventType(str, enum.Enum):
    STORED = "stored"    # the block's KV is now cached on the worker (reusable by a prefix)
    REMOVED = "removed"  # the block was evicted; a prompt can no longer reuse it there


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One event of a worker's `GET /kv_events`, as the worker sends it: its
    backends/core/block_events.KVEvent serialized verbatim, so the field names here ARE the wire
    names (tests/cache/test_prefix_index.py holds the two dataclasses to the same fields)."""

    seq_no: int               # the worker's event sequence number (from 1, increasing; anew after a reset)
    kind: KvEventType         # stored or removed
    block_hash: int           # cache.block_hash chained hash of the block
    parent_hash: int | None   # the previous block's hash (cache.block_hash.ROOT_HASH for a first block);
                              # None on removed. The index ignores it: a chained hash already names its prefix.
    num_tokens: int           # tokens in the block (the worker's block size for stored blocks)
    medium: str = DEVICE      # one of MEDIA: where the block was stored or removed (absent on the wire: device,
                              # from workers older than KV tiers)

    @classmethod
    def from_mapping(cls, body: Mapping[str, Any]) -> KvEvent:
        """Parse one event of `GET /kv_events`; raises ValueError on a malformed one."""
        seq_no, block_hash = body.get("seq_no"), body.get("block_hash")
        parent, num_tokens = body.get("parent_hash"), body.get("num_tokens")
        medium = body.get("medium", DEVICE)
        if not (_is_int(seq_no) and _is_int(block_hash) and (parent is None or _is_int(parent))
                and _is_int(num_tokens) and isinstance(medium, str) and medium in MEDIUM_BITS):
            raise ValueError(f"malformed KV event: {body!r}")
        return cls(seq_no, KvEventType(body.get("kind")), block_hash, parent, num_tokens, medium)

    def to_mapping(self) -> dict[str, Any]:
        """The event as a worker's JSON has it (for fakes and tests that stand in for a worker)."""
        return {"seq_no": self.seq_no, "kind": self.kind.value, "block_hash": self.block_hash,
                "parent_hash": self.parent_hash, "num_tokens": self.num_tokens, "medium": self.medium}


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    events: tuple[KvEvent, ...]  # in sequence order
    next_seq: int                # pass as `since` on the next poll
    reset: bool                  # the worker lost its cache (restart) or our `since` is too old

    @classmethod
    def from_mapping(cls, body: Mapping[str, Any]) -> KvEventBatch:
        """Parse the JSON body of `GET {endpoint}/kv_events?since=N`: {"events": [...], "next": N, "reset": bool}."""
        events, next_seq, reset = body.get("events"), body.get("next"), body.get("reset", False)
        if not isinstance(events, list) or not _is_int(next_seq) or not isinstance(reset, bool):
            raise ValueError(f"malformed KV event batch: keys {sorted(body)!r}")
        return cls(tuple(KvEvent.from_mapping(e) for e in events), next_seq, reset)

    def to_mapping(self) -> dict[str, Any]:
        """The batch as a worker's JSON has it."""
        return {"events": [e.to_mapping() for e in self.events], "next": self.next_seq, "reset": self.reset}


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
