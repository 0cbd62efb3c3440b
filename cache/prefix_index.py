"""Which endpoint holds which KV blocks, on its device or in a KV tier below it (host RAM, local disk,
the shared store). Precise: kept from an engine's KV events (our workers' `/kv_events`, vLLM's ZMQ
stream). Approximate: for an endpoint without events, from the blocks the gateway itself routed there
(`record_routed`). Bounded: per endpoint, an LRU of at most `max_blocks` device blocks (settable: an
estimate of its KV capacity) and one of at most `max_blocks_per_endpoint` tier blocks; per shared store, one of
at most that many store blocks. Pure: no I/O here.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cache.kv_events import DEVICE, MEDIUM_BITS, STORE, KvEvent, KvEventBatch, KvEventType
from cache.lazy_levels import LazyLevels
from cache.tier_runs import MatchedByMedium, SharedStore, held_levels, runs_from, tier_run

_STORE_BIT = MEDIUM_BITS[STORE]


class _EndpointBlocks:
    __slots__ = ("approximate", "bit", "last_seq", "lru", "max_blocks", "store", "tiers")

    def __init__(self, bit: int, max_blocks: int) -> None:
        self.approximate = False                            # fed by record_routed, not by events
        self.bit = bit                                      # this endpoint's bit in holder masks
        self.lru: OrderedDict[int, None] = OrderedDict()    # device blocks: hash -> None, oldest first
        self.tiers: OrderedDict[int, int] = OrderedDict()   # tier blocks: hash -> MEDIUM_BITS of its tiers, by age
        self.last_seq = -1                                  # highest event seq applied
        self.max_blocks = max_blocks                        # device LRU bound (the endpoint's KV capacity)
        self.store: SharedStore | None = None              # the shared store it reads, where its worker names one


class PrefixIndex:
    """Block hashes cached per endpoint and medium. Matches count only the LEADING run of a prompt's
    hashes (chained hashes make a later block useless without all before it).

    A block in the shared store can be read by every worker configured with that store. An endpoint whose worker
    names its store (`share_store`: its load report's key of the store and the KV namespace) is credited with
    every block any of that store's workers announced; one that names none only with the store blocks it
    announced itself (it never claims a hit a worker cannot have). A store's removals are never announced, so
    only the LRU's bound ages its blocks out."""

    def __init__(self, max_blocks_per_endpoint: int = 1 << 16) -> None:
        if max_blocks_per_endpoint < 1:
            raise ValueError("max_blocks_per_endpoint must be >= 1")
        self._max_blocks = max_blocks_per_endpoint
        self._endpoints: dict[str, _EndpointBlocks] = {}
        self._holders: dict[int, int] = {}  # block hash -> bitmask of endpoints holding it on their device
        self._tier_holders: dict[int, int] = {}   # ... holding it in a tier of their own (RAM, disk, own store blocks)
        self._free_bits: list[int] = []     # bits of forgotten endpoints, reused first
        self._next_bit = 1
        self._stores: dict[str, SharedStore] = {}   # store key -> the blocks its workers announced
        self.tiered_mask = 0                # bits of the endpoints holding some block in a KV tier
        self.own_tier_mask = 0              # of those, the ones holding blocks of their own (not a shared store's)

    def apply(self, endpoint_id: str, events: Iterable[KvEvent | Mapping[str, Any]]) -> None:
        """Apply events in order; an event whose seq was already applied is skipped, so a
        re-delivered batch is harmless. A REMOVED leaves the block in its other media."""
        blocks = self._blocks(endpoint_id)
        for event in events:
            if not isinstance(event, KvEvent):
                event = KvEvent.from_mapping(event)
            if event.seq_no <= blocks.last_seq:
                continue
            blocks.last_seq = event.seq_no
            if event.medium != DEVICE:
                self._tier_event(blocks, event.kind, event.block_hash, MEDIUM_BITS[event.medium])
            elif event.kind is KvEventType.STORED:
                self._store(blocks, event.block_hash)
            else:
                self._remove(blocks, event.block_hash)

    def store(self, endpoint_id: str, block_hashes: Iterable[int], medium: str = DEVICE) -> None:
        """Blocks now cached at `endpoint_id` in `medium`, most recent last (events without sequence
        numbers: vLLM's, whose stream the caller orders)."""
        blocks = self._blocks(endpoint_id)
        for block_hash in block_hashes:
            if medium == DEVICE:
                self._store(blocks, block_hash)
            else:
                self._tier_event(blocks, KvEventType.STORED, block_hash, MEDIUM_BITS[medium])

    def remove(self, endpoint_id: str, block_hashes: Iterable[int], medium: str = DEVICE) -> None:
        """Blocks `medium` dropped at `endpoint_id`; unknown ones are ignored."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is not None:
            for block_hash in block_hashes:
                if medium == DEVICE:
                    self._remove(blocks, block_hash)
                else:
                    self._tier_event(blocks, KvEventType.REMOVED, block_hash, MEDIUM_BITS[medium])

    def track_routed(self, endpoint_id: str, max_blocks: int) -> None:
        """Put `endpoint_id` in approximate mode (it publishes no KV events): `record_routed` feeds
        it, within an LRU of `max_blocks` (an estimate of its KV capacity)."""
        self._blocks(endpoint_id).approximate = True
        self.set_capacity(endpoint_id, max_blocks)

    def record_routed(self, endpoint_id: str, block_hashes: Sequence[int]) -> bool:
        """A prompt with these blocks was sent to `endpoint_id`, which will cache them; a no-op (False)
        unless the endpoint is in approximate mode. Stored last block first, so the leading blocks
        (shared by most prompts, and useless once lost because later hashes chain on them) are the
        last the LRU evicts, as an engine's own free list does."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is None or not blocks.approximate:
            return False
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
        return True

    def share_store(self, endpoint_id: str, key: str | None) -> None:
        """`endpoint_id`'s worker reads the shared store named `key` (None: none it names). Its own store blocks
        move into that store's, where every endpoint that reads it is credited with them."""
        if key is None and endpoint_id not in self._endpoints:
            return   # nothing to forget: an endpoint is tracked from its first block or store
        blocks = self._blocks(endpoint_id)
        old = blocks.store
        new = None if key is None else self._stores.get(key)
        if key is not None and new is None:
            new = self._stores[key] = SharedStore(key)
        if new is old:
            return
        if old is not None:
            old.members &= ~blocks.bit
        if new is not None:
            new.members |= blocks.bit
            for block_hash, media in list(blocks.tiers.items()):   # oldest first, as the store's LRU wants them
                if media & _STORE_BIT:
                    self._tier_event(blocks, KvEventType.REMOVED, block_hash, _STORE_BIT)
                    self._shared_event(new, KvEventType.STORED, block_hash)
        blocks.store = new
        self._update_tiered(blocks)

    def store_of(self, endpoint_id: str) -> str | None:
        """The key of the shared store `endpoint_id` reads (None: none it names)."""
        blocks = self._endpoints.get(endpoint_id)
        store = None if blocks is None else blocks.store
        return None if store is None else store.key

    def is_approximate(self, endpoint_id: str) -> bool:
        blocks = self._endpoints.get(endpoint_id)
        return blocks is not None and blocks.approximate

    def set_capacity(self, endpoint_id: str, max_blocks: int) -> None:
        """Bound `endpoint_id`'s device LRU at `max_blocks` (at least 1), evicting the oldest beyond it."""
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
        """Forget everything the endpoint held, in every medium (its cache was lost, or its events were);
        sequence numbers restart."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is None:
            return
        for block_hash in blocks.lru:
            self._unmark(block_hash, blocks.bit)
        blocks.lru.clear()
        for block_hash in blocks.tiers:
            self._unmark(block_hash, blocks.bit, self._tier_holders)
        blocks.tiers.clear()
        self._update_tiered(blocks)   # a shared store's blocks stay: its other workers announced them too
        blocks.last_seq = -1

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint entirely (removed from the config)."""
        self.share_store(endpoint_id, None)
        self.reset(endpoint_id)
        blocks = self._endpoints.pop(endpoint_id, None)
        if blocks is not None:
            self._free_bits.append(blocks.bit)

    def num_matched_blocks(self, endpoint_id: str, block_hashes: Sequence[int]) -> int:
        """Length of the leading run of `block_hashes` cached on `endpoint_id`'s device."""
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
        """`num_matched_blocks` (the device run) for every endpoint at once, in one walk of the prompt's
        hashes; endpoints with no match are left out."""
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

    def matched_levels(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """The device runs of `matched_blocks` as nested holder masks, with no walk over the endpoints: by
        increasing depth, (depth, bitmask of the endpoints whose run is at least `depth`), one pair for each depth
        after which the set shrinks; an endpoint in a level's mask and not the next's has that level's depth."""
        levels: list[tuple[int, int]] = []
        alive = -1
        depth = 0
        get = self._holders.get   # bound once: a lookup per prompt block
        for block_hash in block_hashes:
            holders = get(block_hash, 0) & alive
            if holders != alive and depth:
                levels.append((depth, alive))
            alive = holders
            if not alive:
                return levels
            depth += 1
        if depth:
            levels.append((depth, alive))
        return levels

    def lazy_levels(self, block_hashes: Sequence[int]) -> LazyLevels:
        """`matched_levels(block_hashes)`, walked only when first read."""
        return LazyLevels(self.matched_levels, block_hashes)

    def endpoint_bit(self, endpoint_id: str) -> int:
        """`endpoint_id`'s bit in `matched_levels`' masks (it is tracked from now on, holding nothing yet)."""
        return self._blocks(endpoint_id).bit

    def matched_blocks_by_medium(self, block_hashes: Sequence[int]) -> dict[str, MatchedByMedium]:
        """Every endpoint's leading run of `block_hashes` by medium (`MatchedByMedium`): `matched_blocks`'
        device runs, each followed on through the endpoint's tiers (only endpoints that have tier blocks
        cost more than the device walk); endpoints with no match in any medium are left out."""
        device = self.matched_blocks(block_hashes)
        matched: dict[str, MatchedByMedium] = {}
        store_runs: dict[int, list[int]] = {}   # id of a shared store -> its run from each block of the prompt
        for endpoint_id, blocks in self._endpoints.items():
            run = device.get(endpoint_id, 0)
            store, runs = blocks.store, None
            if store is not None and store.blocks:
                runs = store_runs.get(id(store))
                if runs is None:
                    runs = store_runs[id(store)] = runs_from(store.blocks, block_hashes)
            if runs is not None or blocks.tiers:
                by_medium = tier_run(blocks.tiers, block_hashes, run, runs)
                if any(by_medium):
                    matched[endpoint_id] = by_medium
            elif run:
                matched[endpoint_id] = (run, 0, 0, 0)
        return matched

    def matched_by_medium(self, endpoint_id: str, block_hashes: Sequence[int], num_device: int) -> MatchedByMedium:
        """One endpoint's row of `matched_blocks_by_medium`, its device run `num_device` known (a live view's pick)."""
        blocks = self._endpoints.get(endpoint_id)
        if blocks is None:
            return (num_device, 0, 0, 0)
        store = blocks.store
        runs = runs_from(store.blocks, block_hashes) if store is not None and store.blocks else None
        if runs is None and not blocks.tiers:
            return (num_device, 0, 0, 0)
        return tier_run(blocks.tiers, block_hashes, num_device, runs)

    def store_runs(self, block_hashes: Sequence[int]) -> list[tuple[int, list[int]]]:
        """For each shared store that holds blocks: its readers' bits, less those holding tier blocks of their own,
        and `runs_from` of the prompt in it."""
        return [(store.members & ~self.own_tier_mask, runs_from(store.blocks, block_hashes))
                for store in self._stores.values() if store.blocks and store.members & ~self.own_tier_mask]

    def own_tier_levels(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """`matched_levels` of the endpoints holding tier blocks of their own (`own_tier_mask`), a block counted where
        it is on the device, in one of their tiers or in the shared store they read: a bound on what each holds."""
        own = self.own_tier_mask
        stores = [(s.blocks, s.members) for s in self._stores.values() if s.blocks and s.members & own]
        return held_levels(block_hashes, self._holders, self._tier_holders, stores, own)

    def num_blocks(self, endpoint_id: str) -> int:
        """Blocks indexed on the endpoint's device."""
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

    def _tier_event(self, blocks: _EndpointBlocks, kind: KvEventType, block_hash: int, medium_bit: int) -> None:
        """A tier took (STORED) or dropped (REMOVED) the block; its other media keep it. A shared store's blocks
        are filed in the store's own LRU."""
        if medium_bit == _STORE_BIT and blocks.store is not None:
            self._shared_event(blocks.store, kind, block_hash)
            return
        tiers, tier_holders = blocks.tiers, self._tier_holders
        if kind is KvEventType.STORED:
            if block_hash not in tiers:
                tier_holders[block_hash] = tier_holders.get(block_hash, 0) | blocks.bit
            tiers[block_hash] = tiers.pop(block_hash, 0) | medium_bit  # most recent last
            if len(tiers) > self._max_blocks:
                self._unmark(tiers.popitem(last=False)[0], blocks.bit, tier_holders)
        elif media := tiers.get(block_hash, 0) & ~medium_bit:
            tiers[block_hash] = media
        elif tiers.pop(block_hash, None) is not None:
            self._unmark(block_hash, blocks.bit, tier_holders)
        self._update_tiered(blocks)

    def _shared_event(self, store: SharedStore, kind: KvEventType, block_hash: int) -> None:
        lru = store.blocks
        if kind is KvEventType.STORED:
            was_empty = not lru
            lru.pop(block_hash, None)
            lru[block_hash] = None   # most recent last
            if len(lru) > self._max_blocks:
                lru.popitem(last=False)
            if was_empty:
                self.tiered_mask |= store.members
        else:   # no worker announces one today; its other readers lose it too
            lru.pop(block_hash, None)
            if not lru:
                for blocks in self._endpoints.values():
                    if blocks.bit & store.members:
                        self._update_tiered(blocks)

    def _update_tiered(self, blocks: _EndpointBlocks) -> None:
        """Its bit in `tiered_mask`: set while it holds a tier block or reads a shared store that holds one."""
        if blocks.tiers or (blocks.store is not None and blocks.store.blocks):
            self.tiered_mask |= blocks.bit
        else:
            self.tiered_mask &= ~blocks.bit
        self.own_tier_mask = self.own_tier_mask | blocks.bit if blocks.tiers else self.own_tier_mask & ~blocks.bit

    def _unmark(self, block_hash: int, bit: int, holders: dict[int, int] | None = None) -> None:
        holders = self._holders if holders is None else holders
        mask = holders.get(block_hash, 0) & ~bit
        if mask:
            holders[block_hash] = mask
        else:
            holders.pop(block_hash, None)
