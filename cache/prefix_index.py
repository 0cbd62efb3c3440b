"""Which endpoint holds which KV blocks. Precise: kept from an engine's KV events (our workers'
`/kv_events`, vLLM's ZMQ stream). Approximate: for an endpoint without events, from the blocks the
gateway itself routed there (`record_routed`). Bounded: an LRU of at most `max_blocks` hashes per
endpoint (settable per endpoint: an estimate of its KV capacity). Pure: no I/O here.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard


class KvEventType(str, enum.Enum):
    STORED = "stored"    # the block's KV is now cached on the worker (reusable by a prefix)
    REMOVED = "removed"  # the block was evicted; a prompt can no longer reuse it there


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One event of a worker's `GET /kv_events`, as the worker sends it: its
    backends/engine/kv_events.KVEvent serialized verbatim, so the field names here ARE the wire
    names (tests/cache/test_prefix_index.py holds the two dataclasses to the same fields)."""

    seq_no: int               # the worker's event sequence number (from 1, increasing; anew after a reset)
    kind: KvEventType         # stored or removed
    block_hash: int           # cache.block_hash chained hash of the block
    parent_hash: int | None   # the previous block's hash (cache.block_hash.ROOT_HASH for a first block);
                              # None on removed. The index ignores it: a chained hash already names its prefix.
    num_tokens: int           # tokens in the block (the worker's block size for stored blocks)

    @classmethod
    def from_mapping(cls, body: Mapping[str, Any]) -> KvEvent:
        """Parse one event of `GET /kv_events`; raises ValueError on a malformed one."""
        seq_no, block_hash = body.get("seq_no"), body.get("block_hash")
        parent, num_tokens = body.get("parent_hash"), body.get("num_tokens")
        if not (_is_int(seq_no) and _is_int(block_hash) and (parent is None or _is_int(parent))
                and _is_int(num_tokens)):
            raise ValueError(f"malformed KV event: {body!r}")
        return cls(seq_no, KvEventType(body.get("kind")), block_hash, parent, num_tokens)

    def to_mapping(self) -> dict[str, Any]:
        """The event as a worker's JSON has it (for fakes and tests that stand in for a worker)."""
        return {"seq_no": self.seq_no, "kind": self.kind.value, "block_hash": self.block_hash,
                "parent_hash": self.parent_hash, "num_tokens": self.num_tokens}


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


class _EndpointBlocks:
    __slots__ = ("approximate", "bit", "last_seq", "lru", "max_blocks")

    def __init__(self, bit: int, max_blocks: int) -> None:
        self.approximate = False                            # fed by record_routed, not by events
        self.bit = bit                                      # this endpoint's bit in holder masks
        self.lru: OrderedDict[int, None] = OrderedDict()    # block hash -> None, oldest first
        self.last_seq = -1                                  # highest event seq applied
        self.max_blocks = max_blocks                        # LRU bound (the endpoint's KV capacity)


class PrefixIndex:
    """Block hashes cached per endpoint. `num_matched_blocks` counts only the LEADING run of a
    prompt's hashes (chained hashes make a later block useless without all before it)."""

    def __init__(self, max_blocks_per_endpoint: int = 1 << 16) -> None:
        if max_blocks_per_endpoint < 1:
            raise ValueError("max_blocks_per_endpoint must be >= 1")
        self._max_blocks = max_blocks_per_endpoint
        self._endpoints: dict[str, _EndpointBlocks] = {}
        self._holders: dict[int, int] = {}  # block hash -> bitmask of endpoints holding it
        self._free_bits: list[int] = []     # bits of forgotten endpoints, reused first
        self._next_bit = 1

    def apply(self, endpoint_id: str, events: Iterable[KvEvent | Mapping[str, Any]]) -> None:
        """Apply events in order; an event whose seq was already applied is skipped, so a
        re-delivered batch is harmless."""
        blocks = self._blocks(endpoint_id)
        for event in events:
            if not isinstance(event, KvEvent):
                event = KvEvent.from_mapping(event)
            if event.seq_no <= blocks.last_seq:
                continue
            blocks.last_seq = event.seq_no
            if event.kind is KvEventType.STORED:
                self._store(blocks, event.block_hash)
            else:
                self._remove(blocks, event.block_hash)

    def store(self, endpoint_id: str, block_hashes: Iterable[int]) -> None:
        """Blocks now cached at `endpoint_id`, most recent last (events without sequence numbers:
        vLLM's, whose stream the caller orders)."""
        blocks = self._blocks(endpoint_id)
        for block_hash in block_hashes:
            self._store(blocks, block_hash)

    def remove(self, endpoint_id: str, block_hashes: Iterable[int]) -> None:
        """Blocks evicted at `endpoint_id`; unknown ones are ignored."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is not None:
            for block_hash in block_hashes:
                self._remove(blocks, block_hash)

    def track_routed(self, endpoint_id: str, max_blocks: int) -> None:
        """Put `endpoint_id` in approximate mode (it publishes no KV events): `record_routed` feeds
        it, within an LRU of `max_blocks` (an estimate of its KV capacity)."""
        self._blocks(endpoint_id).approximate = True
        self.set_capacity(endpoint_id, max_blocks)

    def record_routed(self, endpoint_id: str, block_hashes: Sequence[int]) -> None:
        """A prompt with these blocks was sent to `endpoint_id`, which will cache them; a no-op
        unless the endpoint is in approximate mode. Stored last block first, so the leading blocks
        (shared by most prompts, and useless once lost because later hashes chain on them) are the
        last the LRU evicts, as an engine's own free list does."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is None or not blocks.approximate:
            return
        lru, holders, bit = blocks.lru, self._holders, blocks.bit  # `_store` inlined: once per block per request
        for block_hash in reversed(block_hashes):
            if block_hash in lru:
                lru.move_to_end(block_hash)
                continue
            lru[block_hash] = None
            holders[block_hash] = holders.get(block_hash, 0) | bit
            if len(lru) > blocks.max_blocks:
                oldest, _ = lru.popitem(last=False)
                self._unmark(oldest, bit)

    def is_approximate(self, endpoint_id: str) -> bool:
        blocks = self._endpoints.get(endpoint_id)
        return blocks is not None and blocks.approximate

    def set_capacity(self, endpoint_id: str, max_blocks: int) -> None:
        """Bound `endpoint_id`'s LRU at `max_blocks` (at least 1), evicting the oldest beyond it."""
        blocks = self._blocks(endpoint_id)
        blocks.max_blocks = max(1, max_blocks)
        while len(blocks.lru) > blocks.max_blocks:
            oldest, _ = blocks.lru.popitem(last=False)
            self._unmark(oldest, blocks.bit)

    def capacity(self, endpoint_id: str) -> int:
        blocks = self._endpoints.get(endpoint_id)
        return self._max_blocks if blocks is None else blocks.max_blocks

    def apply_batch(self, endpoint_id: str, batch: KvEventBatch) -> None:
        """Apply one `/kv_events` response, resetting first when the worker says so."""
        if batch.reset:
            self.reset(endpoint_id)
        self.apply(endpoint_id, batch.events)

    def reset(self, endpoint_id: str) -> None:
        """Forget everything the endpoint held (its cache was lost); sequence numbers restart."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is None:
            return
        for block_hash in blocks.lru:
            self._unmark(block_hash, blocks.bit)
        blocks.lru.clear()
        blocks.last_seq = -1

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint entirely (removed from the config)."""
        self.reset(endpoint_id)
        blocks = self._endpoints.pop(endpoint_id, None)
        if blocks is not None:
            self._free_bits.append(blocks.bit)

    def num_matched_blocks(self, endpoint_id: str, block_hashes: Sequence[int]) -> int:
        """Length of the leading run of `block_hashes` cached at `endpoint_id`."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is None:
            return 0
        lru = blocks.lru
        n = 0
        for block_hash in block_hashes:
            if block_hash not in lru:
                break
            n += 1
        return n

    def matched_blocks(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """`num_matched_blocks` for every endpoint at once, in one walk of the prompt's hashes;
        endpoints with no match are left out."""
        matched: dict[str, int] = {}
        alive = -1  # every bit set: all endpoints still match
        depth = 0
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash, 0) & alive
            if holders != alive and depth:
                self._record(matched, alive & ~holders, depth)
            alive = holders
            if not alive:
                return matched
            depth += 1
        if depth:
            self._record(matched, alive, depth)
        return matched

    def num_blocks(self, endpoint_id: str) -> int:
        blocks = self._endpoints.get(endpoint_id)
        return 0 if blocks is None else len(blocks.lru)

    def last_seq(self, endpoint_id: str) -> int | None:
        """The highest event seq applied since the last reset (None: none); workers send the
        events after `since`, so this is the `since` of a poller that lost its cursor."""
        blocks = self._endpoints.get(endpoint_id)
        return None if blocks is None or blocks.last_seq < 0 else blocks.last_seq

    def _record(self, matched: dict[str, int], mask: int, depth: int) -> None:
        for endpoint_id, blocks in self._endpoints.items():
            if mask & blocks.bit:
                matched[endpoint_id] = depth

    def _blocks(self, endpoint_id: str) -> _EndpointBlocks:
        blocks = self._endpoints.get(endpoint_id)
        if blocks is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit << 1
            blocks = self._endpoints[endpoint_id] = _EndpointBlocks(bit, self._max_blocks)
        return blocks

    def _store(self, blocks: _EndpointBlocks, block_hash: int) -> None:
        if block_hash in blocks.lru:
            blocks.lru.move_to_end(block_hash)
            return
        blocks.lru[block_hash] = None
        self._holders[block_hash] = self._holders.get(block_hash, 0) | blocks.bit
        if len(blocks.lru) > blocks.max_blocks:
            oldest, _ = blocks.lru.popitem(last=False)
            self._unmark(oldest, blocks.bit)

    def _remove(self, blocks: _EndpointBlocks, block_hash: int) -> None:
        if block_hash in blocks.lru:
            del blocks.lru[block_hash]
            self._unmark(block_hash, blocks.bit)

    def _unmark(self, block_hash: int, bit: int) -> None:
        mask = self._holders.get(block_hash, 0) & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:
            self._holders.pop(block_hash, None)
