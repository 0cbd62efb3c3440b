"""Build the tiered KV connector an `EngineConfig` asks for (--kv-cpu-gb, --kv-disk-dir/--kv-disk-gb,
--kv-store), over a runner's KV cache: the registry's factory for the tiers (../registry.py)."""
from __future__ import annotations

import logging
from typing import Any

from backends.core.block_events import KVEventRing
from backends.core.engine_config import EngineConfig
from backends.kv_connectors.tiers.base import KVTier, namespace
from backends.kv_connectors.tiers.block_io import BlockIO
from backends.kv_connectors.tiers.connector import TieredKVConnector
from backends.kv_connectors.tiers.cpu import CpuTier
from backends.kv_connectors.tiers.disk import DiskTier
from backends.kv_transfer.torch_cache import TorchPagedKV

log = logging.getLogger(__name__)


def build_tiered_connector(config: EngineConfig, kv_cache: Any, weights_fingerprint: str,
                           events: KVEventRing) -> TieredKVConnector:
    """`kv_cache`: the runner's backends/worker/kv_cache.KVCache (or a group's GroupKVCache). `weights_fingerprint`:
    the runner's (backends/worker/fingerprint.py; "": none); a disk or store tier files its blocks under it."""
    if not config.has_kv_tiers:
        raise ValueError("the tiers KV connector needs a tier (--kv-cpu-gb, --kv-disk-dir or --kv-store)")
    if not weights_fingerprint and config.has_kv_tiers_beyond_worker:
        raise ValueError("a KV tier on disk or in a shared store needs the weights' fingerprint "
                         "(ModelRunner(fingerprint_weights=True)): without it, other weights' KV could be read")
    block_io = BlockIO(*kv_cache.stacks)
    layout = TorchPagedKV(list(zip(kv_cache.k, kv_cache.v, strict=True))).layout()
    space = namespace(weights_fingerprint, layout)
    local: list[KVTier] = []
    cpu = disk = None
    if config.kv_cpu_bytes:
        cpu = CpuTier(config.kv_cpu_bytes, block_io.block_nbytes, pinned=block_io.device.type == "cuda")
        local.append(cpu)
    if config.kv_disk_dir:
        disk = DiskTier(config.kv_disk_dir, space, config.kv_disk_bytes, block_io.block_nbytes)
        local.append(disk)
    store = None
    if config.kv_store:
        from backends.kv_connectors.tiers.mooncake_store import MooncakeStoreTier
        store = MooncakeStoreTier(config.kv_store, space, block_io.block_nbytes, segment_bytes=config.kv_store_bytes)
    connector = TieredKVConnector(block_io, kv_cache.spec.block_size, local, store, events,
                                  config.kv_write_queue_blocks, config.kv_read_slower_tiers)
    for tier in (cpu, disk):
        if tier is not None:
            tier.removed = connector.removed_from(tier.medium)
    if cpu is not None and disk is not None:
        cpu.spill = connector.spill_to(disk)
    log.info("KV tiers: %s (namespace %s, %d bytes a block)",
             ", ".join(f"{u.medium} {u.capacity_bytes / 2**30:.2f} GiB" for u in connector.usage()) or "none",
             space, block_io.block_nbytes)
    return connector
