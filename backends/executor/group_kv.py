"""Rank 0's view of a group's paged KV cache, for a KV transfer (P/D) and the KV tiers: every rank's layers in
rank order, its own and those of the ranks it spawned, mapped from their shared-memory caches
(backends/kv_transfer/shm.py).

The transfer then moves a group's KV as one worker's cache of that many layers, each of a rank's KV heads: a
tensor-parallel rank's shard goes to the same rank of a peer group of the same shape, a pipeline stage's layers
to the same stage. Two groups of different shapes see different layouts (layer and head counts) and the pull is
refused with both, as any mismatched pair is. Same-host pulls from a group go over TCP: there is no one region to
offer.

Rank 0 reads and writes the other ranks' blocks only where the engine lets a transfer touch them (held blocks,
or blocks allocated to a sequence still loading), as on one rank; the ranks see rank 0's writes by the next
step, which reaches them through their pipes.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import torch

from backends.executor.messages import Ready
from backends.kv_transfer.base import SharedRegion
from backends.kv_transfer.shm import map_shared_cache
from backends.worker.kv_cache import KVCache, KVCacheSpec


class GroupKVCache:
    """`k` and `v`: per-layer [num_blocks, block_size, num_kv_heads, head_dim] tensors, rank 0's layers first."""

    shared_region: SharedRegion | None = None   # no single region holds a group's cache

    def __init__(self, local: KVCache, ranks: Sequence[Ready]) -> None:
        """`ranks`: the spawned ranks' Ready reports, in rank order; ValueError where one's cache is not shared."""
        spec = local.spec
        self.k, self.v = list(local.k), list(local.v)
        self.stacks: tuple[torch.Tensor, ...] = (local.stacked,)   # each rank's whole cache, for the KV tiers
        for ready in ranks:
            if ready.kv_region is None:
                raise ValueError(f"rank {ready.rank}'s KV cache is not in shared memory (see its log): this group "
                                 "cannot move KV to another worker")
            stacked = map_shared_cache(ready.kv_region, ready.kv_layers,
                                       (spec.block_size, spec.num_kv_heads, spec.head_dim), spec.dtype)
            self.stacks += (stacked,)
            self.k += [stacked[i, 0] for i in range(ready.kv_layers)]
            self.v += [stacked[i, 1] for i in range(ready.kv_layers)]
        self.spec: KVCacheSpec = replace(spec, num_layers=len(self.k))


def group_fingerprint(shape: str, fingerprints: Sequence[str]) -> str:
    """A group's weights fingerprint: its shape's name, then the digest of every rank's (its slices'), in rank
    order. Two groups of one shape on the same weights agree; anything else differs."""
    digest = hashlib.blake2b("\n".join(fingerprints).encode(), digest_size=16).hexdigest()
    return f"{shape}-{digest}"
