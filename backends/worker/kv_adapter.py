"""The worker's paged KV cache as the KV transfer layer sees it: a `KVBlockSource` over the engine's
holds (readers pin their blocks so a release mid-send cannot recycle them) and block digests for tests.

Event-loop only; the hold table and the pins belong to `PDConnector` (backends/kv_connectors/pd_connector.py).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import torch

from backends.kv_transfer.base import CudaIpcRegion, KVLayerReader, KVLayout, SharedRegion
from backends.kv_transfer.torch_cache import TorchPagedKV, byte_view


class HoldTable(Protocol):
    """What `PDConnector` offers the transfer layer."""

    def lookup(self, transfer_id: str) -> Sequence[int] | None: ...

    def release_transfer(self, transfer_id: str) -> bool: ...

    def pin(self, block_ids: Sequence[int]) -> None: ...

    def unpin(self, block_ids: Sequence[int]) -> None: ...


class EngineKVSource:
    """`KVBlockSource` (prefill side): held blocks by transfer id, read in place or staged."""

    def __init__(self, kv: TorchPagedKV, holds: HoldTable) -> None:
        self._kv = kv
        self._holds = holds

    def layout(self) -> KVLayout:
        return self._kv.layout()

    def lookup(self, transfer_id: str) -> Sequence[int] | None:
        return self._holds.lookup(transfer_id)

    def release(self, transfer_id: str) -> bool:
        return self._holds.release_transfer(transfer_id)

    def shared_region(self) -> SharedRegion | CudaIpcRegion | None:
        return self._kv.shared_region()

    def reader(self, block_ids: Sequence[int], max_pieces: int) -> KVLayerReader:
        reader = self._kv.reader(block_ids, max_pieces)
        self._holds.pin(block_ids)
        return _PinnedReader(reader, tuple(block_ids), self._holds)


class _PinnedReader:
    def __init__(self, reader: KVLayerReader, block_ids: tuple[int, ...], holds: HoldTable) -> None:
        self._reader = reader
        self._block_ids = block_ids
        self._holds: HoldTable | None = holds

    def read_layer(self, layer: int) -> Sequence[memoryview]:
        return self._reader.read_layer(layer)

    def close(self) -> None:
        self._reader.close()
        if self._holds is not None:
            self._holds.unpin(self._block_ids)
            self._holds = None


def block_digests(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int]) -> list[str]:
    """blake2b of each block's K then V bytes over all layers (debug: compare KV across workers)."""
    digests = []
    for block in block_ids:
        h = hashlib.blake2b(digest_size=16)
        for k, v in layers:
            h.update(byte_view(k[block].contiguous().cpu()))   # a CUDA cache's block comes to the host first
            h.update(byte_view(v[block].contiguous().cpu()))
        digests.append(h.hexdigest())
    return digests
