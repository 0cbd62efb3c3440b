"""routing_sim's simulated KV tiers: one worker's device pool, host-RAM and disk LRUs, and the store all
workers share; what a prompt's leading run costs to read back and what the gateway ranks it at; the tier
table's options and issue 14's targets. Plain in-memory LRUs of block hashes: no timing here (routing_sim.py
owns the clock).

Write-down (as backends/kv_connectors/tiers/connector.py does for the local tiers): a block the device pool evicts
goes to host RAM unless a local tier has it already; RAM spills what it evicts to disk. The store takes,
with `StoreWrite.EVICT`, what the last local tier evicts (the chain device -> cpu -> disk -> store), or,
with `StoreWrite.THROUGH`, every block a worker caches on its device (the connector's `block_cached`).
A copy read back stays in its tier (both are caches). Read-back: the leading run of the prompt's blocks,
each read from the fastest medium holding it; the run ends at the first block no medium holds.
"""
from __future__ import annotations

import argparse
import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any


class Medium(enum.IntEnum):
    DEVICE = 0
    CPU = 1
    DISK = 2
    STORE = 3


class StoreWrite(str, enum.Enum):
    EVICT = "evict"      # the store takes what the last local tier evicts
    THROUGH = "through"  # the store takes every block a worker caches (another worker can use it at once)


@dataclass(frozen=True, slots=True)
class TierConfig:
    cpu_blocks: int = 0                  # host-RAM tier per worker, blocks (0: none)
    disk_blocks: int = 0                 # local-disk tier per worker, blocks (0: none)
    store_blocks: int | None = 0         # the store, one for all workers, blocks (0: none; None: unbounded)
    store_write: StoreWrite = StoreWrite.EVICT
    # Reading one token back, as a fraction of prefilling it (a guess: RAM over PCIe, NVMe, RDMA from a
    # remote node's RAM or SSD, against compute; no measurement behind them).
    cpu_restore: float = 1 / 20
    disk_restore: float = 1 / 8
    store_restore: float = 1 / 5
    # A block's worth to the gateway's prefix scoring when a tier holds it, against 1.0 on the device. None:
    # 1 - the medium's restore fraction, as prefix_aware scores it from the workers' measured fractions
    # (`measured_tier_weights`); a number: a fixed weight (the policy's cpu/disk/store_weight).
    cpu_weight: float | None = None
    disk_weight: float | None = None
    store_weight: float | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_blocks or self.disk_blocks or self.store_blocks != 0)

    def describe(self) -> str:
        restore = "/".join(f"{v:.3g}" for v in (self.cpu_restore, self.disk_restore, self.store_restore))
        weight = "/".join(f"{self.weight(m):.3g}" for m in (Medium.CPU, Medium.DISK, Medium.STORE))
        return (f"RAM {self.cpu_blocks}, disk {self.disk_blocks} blocks per worker, store {self.store_blocks} for all;"
                f" restore {restore} of prefill per token, scored {weight} of a device block (cpu/disk/store)")

    def restore_fraction(self, medium: Medium) -> float:
        return (0.0, self.cpu_restore, self.disk_restore, self.store_restore)[medium]

    def weight(self, medium: Medium) -> float:
        fixed = (1.0, self.cpu_weight, self.disk_weight, self.store_weight)[medium]
        return max(0.0, 1.0 - self.restore_fraction(medium)) if fixed is None else fixed


class Lru:
    """Block hashes, least recently used first, at most `max_blocks` of them (None: unbounded)."""
    __slots__ = ("blocks", "max_blocks")

    def __init__(self, max_blocks: int | None) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.max_blocks = max_blocks

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def touch(self, block_hash: int) -> None:
        self.blocks.move_to_end(block_hash)

    def put(self, block_hash: int) -> int | None:
        """Add (or touch) a block; the block evicted to make room, if any."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return None
        self.blocks[block_hash] = None
        if self.max_blocks is not None and len(self.blocks) > self.max_blocks:
            return self.blocks.popitem(last=False)[0]
        return None


# A device KV event, in order: (True: stored / False: removed, block hash).
DeviceEvent = tuple[bool, int]


class WorkerCache:
    """One worker's device pool and local tiers, and the store (the same `Lru` for every worker)."""

    def __init__(self, device_blocks: int, config: TierConfig, store: Lru | None) -> None:
        self.config = config
        self.device = Lru(device_blocks)
        self.local = [(medium, Lru(n)) for medium, n in ((Medium.CPU, config.cpu_blocks),
                                                         (Medium.DISK, config.disk_blocks)) if n]
        self.store = store
        # where an evicted block goes, fastest first (the store only in EVICT mode)
        self._chain = [lru for _, lru in self.local]
        if store is not None and config.store_write is StoreWrite.EVICT:
            self._chain.append(store)

    def medium(self, block_hash: int) -> Medium | None:
        """The fastest medium holding the block, without touching it (what the gateway's view tells)."""
        if block_hash in self.device:
            return Medium.DEVICE
        for medium, lru in self.local:
            if block_hash in lru:
                return medium
        if self.store is not None and block_hash in self.store:
            return Medium.STORE
        return None

    def peek_run(self, block_hashes: Sequence[int]) -> list[Medium]:
        """The prompt's leading run, each block's medium, untouched."""
        run = []
        for block_hash in block_hashes:
            medium = self.medium(block_hash)
            if medium is None:
                break
            run.append(medium)
        return run

    def read_run(self, block_hashes: Sequence[int]) -> list[Medium]:
        """The prompt's leading run, each block's medium; touches what it reads, as a load does."""
        run = self.peek_run(block_hashes)
        for block_hash, medium in zip(block_hashes, run, strict=False):
            self._lru(medium).touch(block_hash)
        return run

    def cache(self, block_hashes: Sequence[int]) -> list[DeviceEvent]:
        """Put a prefilled prompt's blocks on the device, writing evicted ones down; the device's KV
        events in order (stored, removed), for the prefix index."""
        events: list[DeviceEvent] = []
        through = self.store if self.config.store_write is StoreWrite.THROUGH else None
        for block_hash in block_hashes:
            if block_hash in self.device:
                self.device.touch(block_hash)
                continue
            evicted = self.device.put(block_hash)
            events.append((True, block_hash))
            if through is not None:
                through.put(block_hash)
            if evicted is not None:
                events.append((False, evicted))
                self._write_down(evicted)
        return events

    def _write_down(self, block_hash: int) -> None:
        if any(block_hash in lru for _, lru in self.local):
            return  # a local tier has it already: the connector skips the write
        for lru in self._chain:
            evicted = lru.put(block_hash)
            if evicted is None:
                return
            block_hash = evicted  # spilled one tier further down

    def _lru(self, medium: Medium) -> Lru:
        if medium is Medium.DEVICE:
            return self.device
        if medium is Medium.STORE:
            assert self.store is not None
            return self.store
        return next(lru for m, lru in self.local if m is medium)


def block_tokens(num_prompt_tokens: int, block_index: int, block_size: int) -> int:
    """Prompt tokens in one block (the last may be partial)."""
    return max(0, min(block_size, num_prompt_tokens - block_index * block_size))


def restore_tokens(config: TierConfig, run: Sequence[Medium], num_prompt_tokens: int, block_size: int) -> float:
    """Reading `run` back, in prompt tokens' worth of prefill: each block's tokens x its medium's restore fraction."""
    return sum(block_tokens(num_prompt_tokens, i, block_size) * config.restore_fraction(medium)
               for i, medium in enumerate(run))


NO_TIERS = TierConfig()
# One unbounded store that every worker writes through and reads for free: the hit-rate ceiling.
UNLIMITED_TIERS = TierConfig(store_blocks=None, store_write=StoreWrite.THROUGH, store_restore=0.0)


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    tiers = parser.add_argument_group("KV tiers (issue 14)")
    tiers.add_argument("--tiers", action="store_true",
                       help="the tier table: each policy without tiers, then +RAM, +disk, +store (cumulative)")
    tiers.add_argument("--cpu-blocks", type=int, default=None, help="host RAM per worker (default 4x --cache-blocks)")
    tiers.add_argument("--disk-blocks", type=int, default=None, help="disk per worker (default 16x --cache-blocks)")
    tiers.add_argument("--store-blocks", type=int, default=None,
                       help="the shared store, all workers together (default 64x --cache-blocks; 0: off)")
    tiers.add_argument("--restore-holds-prefill", action="store_true",
                       help="a read-back starts when the request's prefill does and holds it (default: it starts "
                            "when the request reaches its worker, while the queue ahead of it runs)")
    defaults = TierConfig()
    for name in ("cpu", "disk", "store"):
        tiers.add_argument(f"--{name}-restore", type=float, default=getattr(defaults, f"{name}_restore"),
                           help=f"reading a token back from {name}, as a fraction of prefilling it")
        tiers.add_argument(f"--{name}-weight", type=float, default=None,
                           help=f"a {name} block's fixed worth to prefix scoring, against 1 on the device "
                                f"(default: 1 - --{name}-restore, as the gateway weighs measured restore costs)")


def tier_steps(args: argparse.Namespace) -> list[tuple[str, TierConfig]]:
    """The tier table's columns of tiers, cumulative: none, +RAM, +disk, +store (written down from
    disk), +store written through."""
    n = args.cache_blocks
    cpu = n * 4 if args.cpu_blocks is None else args.cpu_blocks
    disk = n * 16 if args.disk_blocks is None else args.disk_blocks
    store = n * 64 if args.store_blocks is None else args.store_blocks
    base = TierConfig(**{f"{t}_{k}": getattr(args, f"{t}_{k}") for t in ("cpu", "disk", "store")
                         for k in ("restore", "weight")})
    local = replace(base, cpu_blocks=cpu, disk_blocks=disk)
    return [("", base), (" +RAM", replace(base, cpu_blocks=cpu)), (" +disk", local),
            (" +store", replace(local, store_blocks=store)),
            (" +store through", replace(local, store_blocks=store, store_write=StoreWrite.THROUGH))]


def missed_targets(row: dict[str, Any], unlimited: dict[str, Any], best: dict[str, Any],
                   unlimited_blocks: float) -> list[str]:
    """Issue 14's targets a summarized row misses: hit rate >= 95% of the unlimited row's, block hit
    rate >= 95% of an unlimited cache's in trace order, busiest/mean busy <= 1.1, TTFT p50 <= half of
    `best`'s (today's best policy, without tiers)."""
    checks = [("hit", row["hit_rate"] >= 0.95 * unlimited["hit_rate"]),
              ("blocks", row["block_hit_rate"] >= 0.95 * unlimited_blocks),
              ("load", row["busy_imbalance"] <= 1.1), ("ttft", 2 * row["ttft_p50_s"] <= best["ttft_p50_s"])]
    return [name for name, ok in checks if not ok]
