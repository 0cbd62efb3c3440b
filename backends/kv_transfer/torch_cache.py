"""`TorchPagedKV`: a paged KV cache of per-layer torch tensors seen as a `KVBlockSource` and
`KVBlockSink`. Contiguous block runs on CPU are sent and received in place; anything else goes
through one reusable staging buffer per transfer (pinned host memory when the cache is on CUDA).

The engine supplies the holds (`BlockHolds`); this module never decides what is held.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from backends.kv_transfer.base import CudaIpcRegion, KVDtype, KVLayerReader, KVLayerWriter, KVLayout, SharedRegion
from backends.kv_transfer.cuda_ipc import export_region
from backends.kv_transfer.shm import word_dtype

_DTYPES = {torch.float32: KVDtype.FLOAT32, torch.float16: KVDtype.FLOAT16,
           torch.bfloat16: KVDtype.BFLOAT16, torch.float8_e4m3fn: KVDtype.FLOAT8_E4M3FN,
           torch.float8_e5m2: KVDtype.FLOAT8_E5M2}
_MAX_POOLED = 4  # free staging buffers kept per cache; more are freed on return
_MIN_RECV_PIECE_BYTES = 256 * 1024  # received in place only if runs average at least this


class BlockHolds(Protocol):
    """The engine's table of blocks held for transfer (its "hold under a handle" feature)."""

    def lookup(self, transfer_id: str) -> Sequence[int] | None: ...

    def release(self, transfer_id: str) -> bool: ...


class DictBlockHolds:
    """A plain table of holds, for tests, benchmarks and a worker without an engine behind it."""

    def __init__(self) -> None:
        self._holds: dict[str, tuple[int, ...]] = {}

    def hold(self, transfer_id: str, block_ids: Sequence[int]) -> None:
        self._holds[transfer_id] = tuple(block_ids)

    def lookup(self, transfer_id: str) -> Sequence[int] | None:
        return self._holds.get(transfer_id)

    def release(self, transfer_id: str) -> bool:
        return self._holds.pop(transfer_id, None) is not None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat writable memoryview of a contiguous CPU tensor's bytes (any dtype, bf16 included)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return tensor.view(torch.uint8).reshape(-1).numpy().data


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, length) of each ascending run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class TorchPagedKV:
    """Per-layer (K, V) tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]. `weights`: the
    fingerprint of the weights that fill them (`KVLayout.weights`; "": not known)."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 holds: BlockHolds | None = None, region: SharedRegion | None = None, weights: str = "") -> None:
        k0 = layers[0][0]
        if k0.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {k0.dtype}")
        for k, v in layers:
            if k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype or v.dtype != k0.dtype:
                raise ValueError("every layer's K and V must share one shape and dtype")
            if not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("KV cache tensors must be contiguous")
        self.layers = tuple(layers)
        self.num_blocks = k0.shape[0]
        self.device = k0.device
        self.holds = holds if holds is not None else DictBlockHolds()
        self.region: SharedRegion | CudaIpcRegion | None = region   # where other processes can read these tensors
        self._exported = False   # CUDA: export_region has been tried
        self._layout = KVLayout(num_layers=len(layers), block_size=k0.shape[1], num_kv_heads=k0.shape[2],
                                head_dim=k0.shape[3], dtype=_DTYPES[k0.dtype], weights=weights)
        self._free_staging: list[torch.Tensor] = []

    # -- KVBlockSource / KVBlockSink ----------------------------------------------------------

    def layout(self) -> KVLayout:
        return self._layout

    def lookup(self, transfer_id: str) -> Sequence[int] | None:
        return self.holds.lookup(transfer_id)

    def release(self, transfer_id: str) -> bool:
        return self.holds.release(transfer_id)

    def shared_region(self) -> SharedRegion | CudaIpcRegion | None:
        if self.region is None and self.device.type == "cuda" and not self._exported:
            self._exported = True
            self.region = export_region(self.layers)   # once: the cache lives as long as this process
        return self.region

    def reader(self, block_ids: Sequence[int], max_pieces: int) -> KVLayerReader:
        return _Transfer(self, self._checked(block_ids), max_pieces)

    def writer(self, block_ids: Sequence[int]) -> KVLayerWriter:
        ids = self._checked(block_ids)
        # Land in place when runs are long enough that one receive call per run is cheap.
        max_pieces = max(2, 2 * len(ids) * self._layout.block_nbytes // _MIN_RECV_PIECE_BYTES)
        return _Transfer(self, ids, max_pieces)

    # -- helpers for _Transfer ----------------------------------------------------------------

    def _checked(self, block_ids: Sequence[int]) -> list[int]:
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:5]} outside the cache's {self.num_blocks} blocks")
        if len(set(ids)) != len(ids):
            raise ValueError("block ids repeat")
        return ids

    def _acquire_staging(self, nbytes: int) -> torch.Tensor:
        # By position, never list.remove: that compares tensors with ==, elementwise (and raises on
        # buffers of different sizes).
        fits = [i for i, buf in enumerate(self._free_staging) if buf.numel() >= nbytes]
        if fits:
            return self._free_staging.pop(min(fits, key=lambda i: self._free_staging[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def _return_staging(self, buf: torch.Tensor) -> None:
        self._free_staging.append(buf)
        if len(self._free_staging) > _MAX_POOLED:
            sizes = [b.numel() for b in self._free_staging]
            self._free_staging.pop(sizes.index(min(sizes)))


class _Transfer:
    """One transfer's view of the cache: a reader (prefill side) or a writer (decode side)."""

    def __init__(self, kv: TorchPagedKV, block_ids: list[int], max_pieces: int) -> None:
        self._kv = kv
        self._block_ids = block_ids
        runs = _runs(block_ids)
        # In place: the (K runs, V runs) pieces are views of the cache itself; else staged.
        in_place = not block_ids or (kv.device.type == "cpu" and 2 * len(runs) <= max_pieces)
        self._runs = runs if in_place else None
        # Taken at the first layer: a reader that only pins blocks (a direct copy) or a writer that a direct
        # copy fills never stages.
        self._staging: torch.Tensor | None = None
        block_nbytes = kv.layout().block_nbytes
        self._word = word_dtype(block_nbytes)
        self._row_len = block_nbytes // self._word.itemsize

    def _stage(self) -> None:
        if self._staging is not None:
            return
        n, kv = len(self._block_ids), self._kv
        nbytes = 2 * kv.layout().block_nbytes * n
        self._staging = kv._acquire_staging(nbytes)
        # [2 (K, V), n, words per block] over the first nbytes of the flat byte buffer
        self._rows_staging = self._staging[:nbytes].view(self._word).view(2, n, self._row_len)
        self._index = torch.tensor(self._block_ids, dtype=torch.long, device=kv.device)
        self._index_np = self._index.numpy() if kv.device.type == "cpu" else None

    def _rows(self, cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, words per block] view of one K or V cache tensor."""
        return cache.view(self._word).view(cache.shape[0], self._row_len)

    def _in_place(self, layer: int) -> list[memoryview]:
        assert self._runs is not None
        size = self._kv.layout().block_nbytes
        # Slicing one memoryview per tensor is ~50x cheaper than a torch view per run.
        return [whole[first * size:(first + n) * size]
                for whole in map(byte_view, self._kv.layers[layer]) for first, n in self._runs]

    def read_layer(self, layer: int) -> Sequence[memoryview]:
        if self._runs is not None:
            return self._in_place(layer)
        self._stage()
        k, v = self._kv.layers[layer]
        if self._index_np is not None:
            # numpy, not torch: single-threaded, so no OpenMP spin when cores are oversubscribed,
            # and mode="clip" (ids were checked) lets take() write straight into the staging rows.
            np.take(self._rows(k).numpy(), self._index_np, axis=0, out=self._rows_staging[0].numpy(), mode="clip")
            np.take(self._rows(v).numpy(), self._index_np, axis=0, out=self._rows_staging[1].numpy(), mode="clip")
        else:  # CUDA: gather on the device, one D2H copy into pinned memory, wait for it
            self._rows_staging[0].copy_(self._rows(k).index_select(0, self._index), non_blocking=True)
            self._rows_staging[1].copy_(self._rows(v).index_select(0, self._index), non_blocking=True)
            torch.cuda.current_stream(self._kv.device).synchronize()
        return byte_view(self._rows_staging[0]), byte_view(self._rows_staging[1])

    def layer_buffer(self, layer: int) -> Sequence[memoryview]:
        if self._runs is not None:
            return self._in_place(layer)
        self._stage()
        if self._kv.device.type == "cuda":
            # The previous layer's H2D copy reads this one staging buffer: let it finish first
            # (a second buffer would overlap the copy with the next layer's receive).
            torch.cuda.current_stream(self._kv.device).synchronize()
        return byte_view(self._rows_staging[0]), byte_view(self._rows_staging[1])

    def commit_layer(self, layer: int) -> None:
        if self._runs is not None:
            return  # the bytes landed in the cache itself
        k, v = self._kv.layers[layer]
        if self._index_np is not None:
            # numpy's fancy assignment scatters rows ~4x faster than torch's index_copy_ on CPU
            self._rows(k).numpy()[self._index_np] = self._rows_staging[0].numpy()
            self._rows(v).numpy()[self._index_np] = self._rows_staging[1].numpy()
        else:
            on_device = self._rows_staging.to(self._kv.device, non_blocking=True)
            self._rows(k).index_copy_(0, self._index, on_device[0])
            self._rows(v).index_copy_(0, self._index, on_device[1])

    def close(self) -> None:
        if self._staging is not None:
            if self._kv.device.type == "cuda":
                torch.cuda.current_stream(self._kv.device).synchronize()
            self._kv._return_staging(self._staging)
            self._staging = None
