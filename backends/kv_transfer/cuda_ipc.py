"""Same-GPU KV transfer through CUDA IPC: a prefill worker exports its paged cache's device memory, a
decode worker on the same GPU opens it and copies held blocks device to device, with no trip through
host memory or a socket.

torch's own CUDA sharing does the work (`torch.multiprocessing.reductions`: the IPC handle of the allocation,
the producer's reference counter, an event the first opening waits on); this module only carries its fields
in the BEGIN frame as JSON, never as a pickle. The TCP connection still carries the control frames and keeps
the blocks pinned while they are copied, as for shared memory (shm.py).

A cache is exported once and each decode process opens it once, keeping the opening for the next pulls: a
share per pull would chain a new reference counter onto the cache's memory each time. The prefill process
frees its cache only when it exits, so the counter (which guards a freed allocation still in use) has nothing
to guard before then.

Ordering: the prefill worker answered its leg only after sampling the prompt's last token, which waits
for every kernel before it, the KV writes included; and the decode side synchronises its copy before it
says COPIED, after which the prefill worker may reuse the blocks.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from backends.kv_transfer.base import CudaIpcRegion, KVLayout, SharedRegion
from backends.kv_transfer.shm import joint_runs, stacked_bytes, word_dtype

log = logging.getLogger(__name__)

_MAX_RUN_COPIES = 8   # more runs than this: one gather and one scatter instead of a copy per run


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID ("" where torch does not say): device indexes differ between processes
    (CUDA_VISIBLE_DEVICES), the UUID does not."""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")


def export_region(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> CudaIpcRegion | None:
    """The IPC description of a CUDA cache laid out as one buffer [layers, 2, blocks, ...] (KVCache's), or
    None when it is not one buffer or cannot be shared here. Once per cache (TorchPagedKV keeps it)."""
    stacked = stacked_bytes(layers)
    if stacked is None or not device_uuid(stacked.device):
        return None
    try:
        (_, args) = reduce_tensor(stacked)
    except RuntimeError as exc:   # e.g. memory the caching allocator did not allocate
        log.warning("the KV cache cannot be shared through CUDA IPC (%s): same-GPU pulls stream over TCP", exc)
        return None
    (_, _, _, tensor_offset, _, _, _, handle, storage_nbytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return CudaIpcRegion(device_uuid=device_uuid(stacked.device), pid=os.getpid(), handle=bytes(handle).hex(),
                         storage_nbytes=storage_nbytes, storage_offset=storage_offset, tensor_offset=tensor_offset,
                         ref_counter_handle=bytes(ref_handle).hex(), ref_counter_offset=ref_offset,
                         event_handle=bytes(event_handle or b"").hex(), event_sync_required=bool(event_sync),
                         num_blocks=stacked.shape[2])


def open_region(region: CudaIpcRegion, layout: KVLayout, device: torch.device) -> torch.Tensor | None:
    """The [num_layers, 2, num_blocks, block bytes] uint8 view of a peer's cache on `device`, or None when it
    cannot be opened here (another GPU, this same process, IPC refused by the driver or the container)."""
    if region.pid == os.getpid():
        return None   # a process cannot open its own IPC handle
    if not region.device_uuid or region.device_uuid != device_uuid(device):
        log.info("peer's KV cache is on another GPU (%s); pulling over TCP", region.device_uuid)
        return None
    shape = (layout.num_layers, 2, region.num_blocks, layout.block_nbytes)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    if region.tensor_offset + numel > region.storage_nbytes:
        log.warning("peer's CUDA IPC region is smaller than its layout; pulling over TCP")
        return None
    strides = (2 * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, shape, strides, region.tensor_offset, torch.storage.TypedStorage, torch.uint8,
            device.index if device.index is not None else torch.cuda.current_device(),
            bytes.fromhex(region.handle), region.storage_nbytes, region.storage_offset, False,
            bytes.fromhex(region.ref_counter_handle), region.ref_counter_offset,
            bytes.fromhex(region.event_handle), region.event_sync_required)
    except (RuntimeError, OSError) as exc:
        log.info("peer's KV cache could not be opened through CUDA IPC (%s); pulling over TCP", exc)
        return None


def _words(t: torch.Tensor) -> torch.Tensor:
    """[layers, 2, blocks, words]: whole words per element, so a copy moves 8 bytes per thread, not 1."""
    try:
        return t.view(word_dtype(t.shape[3]))
    except RuntimeError:   # an offset not a multiple of the word
        return t


def copy_blocks(source: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]) -> int:
    """Copy blocks src_ids of a peer's cache into dst_ids of ours (both [layers, 2, blocks, block bytes] on one
    GPU), every layer's K and V at once, then wait for the copy; returns the bytes copied."""
    runs = joint_runs(src_ids, dst_ids)
    src_w, dst_w = _words(source), _words(dst)
    if src_w.dtype != dst_w.dtype:
        src_w, dst_w = source, dst
    if len(runs) <= _MAX_RUN_COPIES:
        for s, d, n in runs:
            dst_w[:, :, d:d + n].copy_(src_w[:, :, s:s + n])
    else:
        src_index = torch.tensor(list(src_ids), dtype=torch.long, device=dst.device)
        dst_index = torch.tensor(list(dst_ids), dtype=torch.long, device=dst.device)
        dst_w.index_copy_(2, dst_index, src_w.index_select(2, src_index))
    torch.cuda.current_stream(dst.device).synchronize()
    return source.shape[0] * 2 * len(dst_ids) * source.shape[3]


class CudaIpcMappings:
    """The decode side's opened peer caches, by server; one per transport. A server's cache is opened once and
    kept for its next pulls; a new export from the same address (the prefill worker restarted) replaces it."""

    def __init__(self) -> None:
        self._opened: dict[tuple[str, int], tuple[tuple[str, int], torch.Tensor]] = {}
        self._refused: set[tuple[str, int]] = set()   # (host, port) whose cache could not be opened

    def wanted(self, host: str, port: int) -> bool:
        return (host, port) not in self._refused

    def source(self, region: CudaIpcRegion, layout: KVLayout, device: torch.device,
               host: str, port: int) -> torch.Tensor | None:
        export = (region.handle, region.storage_offset)
        known = self._opened.get((host, port))
        if known is not None and known[0] == export and known[1].shape[2] == region.num_blocks:
            return known[1]
        self._opened.pop((host, port), None)
        opened = open_region(region, layout, device)
        if opened is None:
            self._refused.add((host, port))
            return None
        self._opened[(host, port)] = (export, opened)
        return opened

    def close(self) -> None:
        self._opened.clear()


class CudaIpcPull:
    """One pull's CUDA IPC path (tcp_client.SharedCopier): open the peer's cache, copy the announced blocks
    into local `dst_ids` of a CUDA cache laid out as one buffer."""

    kind = "cuda_ipc"

    def __init__(self, mappings: CudaIpcMappings, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 dst_ids: Sequence[int], layout: KVLayout, host: str, port: int) -> None:
        self._mappings = mappings
        self._dst = stacked_bytes(layers)
        self._dst_ids = list(dst_ids)
        self._layout = layout
        self._server = (host, port)
        self._source: torch.Tensor | None = None

    def prepare(self, region: SharedRegion | CudaIpcRegion) -> bool:
        if not isinstance(region, CudaIpcRegion) or self._dst is None:
            return False
        self._source = self._mappings.source(region, self._layout, self._dst.device, *self._server)
        return self._source is not None

    def copy(self, src_block_ids: list[int]) -> int:
        assert self._source is not None and self._dst is not None, "prepare() first"
        return copy_blocks(self._source, src_block_ids, self._dst, self._dst_ids)
