"""The paged KV cache tensors of one worker: per layer K and V of [num_blocks, block_size, num_kv_heads, head_dim].

Layer-major (one K and one V tensor per layer, flash-attn's paged layout) so a KV transfer can send
layer by layer. Owns only the tensors and block copies; which block belongs to whom is the block manager's.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.kv_transfer.base import SharedRegion
from backends.kv_transfer.shm import SharedKVFile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int      # decoder layers, one K and one V tensor each
    num_blocks: int      # physical blocks per layer
    block_size: int      # tokens per block
    num_kv_heads: int    # KV heads per token
    head_dim: int        # channels per head
    dtype: torch.dtype   # element type of the cache

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        elems = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return elems * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    """K and V tensors for every layer, allocated once as one zero-filled buffer laid out
    [num_layers, 2 (K, V), num_blocks, ...], so a KV transfer copies a run of blocks of every layer at once.

    Zero-filled, not empty: attention over padded block tables reads (and masks) stale slots, and a
    NaN bit pattern there would survive a zero attention weight (0 * NaN = NaN).
    `shared`: on CPU, put the buffer in shared memory so that decode workers on this host can copy held
    blocks straight out of it (backends/kv_transfer/shm.py); private memory when that fails.
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device | str, shared: bool = False) -> None:
        self.spec = spec
        block_shape = (spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.shared: SharedKVFile | None = None
        if shared and torch.device(device).type == "cpu":
            try:
                self.shared = SharedKVFile(spec.num_layers, spec.num_blocks, block_shape, spec.dtype)
            except OSError as exc:
                log.warning("KV cache not in shared memory (%s): same-host transfers go over TCP", exc)
        if self.shared is not None:
            stacked = self.shared.tensor
        else:
            stacked = torch.zeros((spec.num_layers, 2, spec.num_blocks, *block_shape), dtype=spec.dtype, device=device)
        self.stacked = stacked   # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.k: list[torch.Tensor] = [stacked[i, 0] for i in range(spec.num_layers)]
        self.v: list[torch.Tensor] = [stacked[i, 1] for i in range(spec.num_layers)]

    @property
    def stacks(self) -> tuple[torch.Tensor, ...]:
        """The cache as the KV tiers copy its blocks (backends/kv_connectors/tiers/block_io.py): its one buffer."""
        return (self.stacked,)

    @property
    def shared_region(self) -> SharedRegion | None:
        """Where the cache lies in shared memory, if it does."""
        return None if self.shared is None else self.shared.region

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def _index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long).to(self.device)

    def read_blocks(self, layer: int, block_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of `block_ids` in `layer`: each [len(block_ids), block_size, num_kv_heads, head_dim]."""
        index = self._index(block_ids)
        return self.k[layer].index_select(0, index), self.v[layer].index_select(0, index)

    def write_blocks(self, layer: int, block_ids: Sequence[int] | torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Overwrite whole blocks of `layer` with `k`/`v` shaped as `read_blocks` returns them."""
        index = self._index(block_ids)
        self.k[layer].index_copy_(0, index, k.to(self.k[layer]))
        self.v[layer].index_copy_(0, index, v.to(self.v[layer]))

    def copy_blocks(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        """Copy block src[i] to dst[i] in every layer (copy-on-write of a shared partial block)."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("src and dst block lists differ in length")
        src, dst = self._index(src_block_ids), self._index(dst_block_ids)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))
