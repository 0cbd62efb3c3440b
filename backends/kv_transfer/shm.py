"""Same-host KV transfer through shared memory: a prefill worker's paged KV cache lives in a memfd,
a decode worker on the same host maps it read-only and copies held blocks straight into its own
cache: one memcpy per run of blocks instead of a trip through loopback TCP.

The TCP connection still carries the control frames (PULL, BEGIN, COPIED, DONE) and keeps the
blocks pinned while they are copied (docs/kv_transfer.md, "Shared memory").
"""
from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import secrets
import stat
import weakref
from collections.abc import Sequence

import torch

from backends.kv_transfer.base import CudaIpcRegion, KVLayout, SharedRegion

log = logging.getLogger(__name__)

REGION_MAGIC = b"SYKVSHM1"
HEADER_BYTES = 4096                 # the magic and nonce, then the cache, page-aligned
_PROC_FD = re.compile(r"/proc/\d+/fd/\d+")   # the only paths a client opens


class SharedKVFile:
    """A zero-filled anonymous shared-memory file (memfd) holding a whole paged cache.

    Other processes of the same user open it as /proc/<pid>/fd/<fd>, so it has no name to leak: the
    memory goes when this process and every mapping of it are gone, even after a SIGKILL.
    `tensor` is [num_layers, 2, num_blocks, *block_shape] of `dtype`; layer i's K is tensor[i, 0].
    """

    def __init__(self, num_layers: int, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype) -> None:
        nonce = secrets.token_hex(16)
        shape = (num_layers, 2, num_blocks, *block_shape)
        nbytes = HEADER_BYTES + math.prod(shape) * dtype.itemsize
        fd = os.memfd_create("switchyard-kv", os.MFD_CLOEXEC)
        try:
            # Reserve every page now: too little memory fails here rather than with SIGBUS on a later write.
            os.posix_fallocate(fd, 0, nbytes)
            os.pwrite(fd, REGION_MAGIC + bytes.fromhex(nonce), 0)
            whole = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        self._closer = weakref.finalize(self, os.close, fd)
        self.tensor = whole[HEADER_BYTES:].view(dtype).view(shape)
        self.region = SharedRegion(f"/proc/{os.getpid()}/fd/{fd}", nonce, HEADER_BYTES, num_blocks)

    def close(self) -> None:
        """Stop offering the memory to other processes (the mapping lives on while tensors use it)."""
        self._closer()


def map_shared_cache(region: SharedRegion, num_layers: int, block_shape: Sequence[int],
                     dtype: torch.dtype) -> torch.Tensor:
    """Another process's SharedKVFile, mapped shared and writable: [num_layers, 2, num_blocks, *block_shape] of
    `dtype` (a group's rank 0 moves its ranks' KV through these). OSError where it cannot be opened or is not the
    cache the region names."""
    nbytes = region.offset + num_layers * 2 * region.num_blocks * math.prod(block_shape) * dtype.itemsize
    if _PROC_FD.fullmatch(region.path) is None:
        raise OSError(f"shared KV region {region.path!r} is not a /proc/<pid>/fd/<n> path")
    fd = os.open(region.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < nbytes or os.pread(fd, len(REGION_MAGIC) + 16, 0) != (
                REGION_MAGIC + bytes.fromhex(region.nonce)):
            raise OSError(f"{region.path} is not the shared KV cache its region names")
    finally:
        os.close(fd)
    whole = torch.from_file(region.path, shared=True, size=nbytes, dtype=torch.uint8)
    return whole[region.offset:].view(dtype).view(num_layers, 2, region.num_blocks, *block_shape)


def stacked_bytes(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """A [num_layers, 2, num_blocks, block bytes] uint8 view of caches laid out as one buffer in that order
    (SharedKVFile's and KVCache's are, on any device), else None."""
    k0 = layers[0][0]
    num_blocks, block_bytes = k0.shape[0], k0[0].numel() * k0.element_size()
    stride = num_blocks * block_bytes
    base = k0.data_ptr()
    for i, (k, v) in enumerate(layers):
        if k.data_ptr() != base + 2 * i * stride or v.data_ptr() != base + (2 * i + 1) * stride:
            return None
    flat = k0.view(-1).view(torch.uint8)
    storage = flat.untyped_storage()
    if storage.data_ptr() + storage.nbytes() < base + 2 * len(layers) * stride:
        return None
    shape = (len(layers), 2, num_blocks, block_bytes)
    strides = (2 * num_blocks * block_bytes, num_blocks * block_bytes, block_bytes, 1)  # contiguous
    return torch.empty(0, dtype=torch.uint8, device=k0.device).set_(storage, flat.storage_offset(), shape, strides)


def word_dtype(nbytes: int) -> torch.dtype:
    """The widest integer type dividing a block: gathers and scatters then move whole words per
    element (torch's bf16 index_select is ~100x slower than int64 rows)."""
    return next(dt for dt in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % dt.itemsize == 0)


def joint_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, length) of the runs where both id lists ascend by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class SharedMappings:
    """The decode side's read-only mappings of prefill caches, by path; one per transport."""

    def __init__(self) -> None:
        self._maps: dict[tuple[str, str], tuple[mmap.mmap, torch.Tensor]] = {}
        self._refused: set[tuple[str, int]] = set()   # (host, port) whose region could not be mapped

    def wanted(self, host: str, port: int) -> bool:
        """Whether to ask this server for shared memory (not after its region failed to map once)."""
        return (host, port) not in self._refused

    def source(self, region: SharedRegion, layout: KVLayout, host: str, port: int) -> torch.Tensor | None:
        """The [num_layers, 2, num_blocks, block bytes] view of a region, or None (remembered for
        this server) when it cannot be mapped here: another host, another container, another user."""
        key = (region.path, region.nonce)
        if key not in self._maps:
            mapped = _map_region(region, layout)
            if mapped is None:
                self._refused.add((host, port))
                return None
            self._maps[key] = mapped
        return self._maps[key][1]

    def close(self) -> None:
        for mapping, _ in self._maps.values():
            with contextlib.suppress(BufferError):  # a copy still holds a view; the mapping goes when it does
                mapping.close()
        self._maps.clear()


def _map_region(region: SharedRegion, layout: KVLayout) -> tuple[mmap.mmap, torch.Tensor] | None:
    """Map a region a server named, trusting nothing in the name: only another process's descriptor
    of a regular file, opened without blocking, that starts with the magic and the nonce."""
    need = region.offset + 2 * layout.num_layers * region.num_blocks * layout.block_nbytes
    if _PROC_FD.fullmatch(region.path) is None:
        log.warning("shared KV region %r is not a /proc/<pid>/fd/<n> path; pulling over TCP", region.path)
        return None
    try:
        fd = os.open(region.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < need:
                log.info("shared KV region %s is not a file of the announced size", region.path)
                return None
            # Private (copy-on-write): reads see the server's memory, a stray write could only change
            # our own copy of a page. Writable, so torch can wrap it without a warning.
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
    except OSError as exc:
        log.info("shared KV region %s not usable here (%s); pulling over TCP", region.path, exc)
        return None
    if mapping[:len(REGION_MAGIC) + 16] != REGION_MAGIC + bytes.fromhex(region.nonce):
        log.info("shared KV region %s belongs to another cache; pulling over TCP", region.path)
        mapping.close()
        return None
    view = torch.frombuffer(mapping, dtype=torch.uint8, count=need - region.offset, offset=region.offset)
    return mapping, view.view(layout.num_layers, 2, region.num_blocks, layout.block_nbytes)


def copy_blocks(source: torch.Tensor, src_ids: Sequence[int], sink_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                dst_ids: Sequence[int]) -> int:
    """Copy blocks src_ids of a mapped region ([layers, 2, blocks, block bytes]) into dst_ids of a CPU
    cache, every layer's K and V, one strided copy per run of ids consecutive on both sides (measured
    faster than a gather and a scatter even for single-block runs); returns the bytes copied. torch's
    copies run on its intra-op threads and release the GIL, so this runs well in a worker thread."""
    runs = joint_runs(src_ids, dst_ids)
    dst = stacked_bytes(sink_layers)
    if dst is not None:
        for s, d, n in runs:
            dst[:, :, d:d + n].copy_(source[:, :, s:s + n])
    else:
        for layer, (k, v) in enumerate(sink_layers):
            k_rows, v_rows = (t.view(torch.uint8).view(t.shape[0], -1) for t in (k, v))
            for s, d, n in runs:
                k_rows[d:d + n].copy_(source[layer, 0, s:s + n])
                v_rows[d:d + n].copy_(source[layer, 1, s:s + n])
    return source.shape[0] * 2 * len(dst_ids) * source.shape[3]


class SharedPull:
    """One pull's shared-memory path (tcp_client.SharedCopier): map the server's region, copy the
    announced blocks into local `dst_ids` of a CPU cache."""

    kind = "memfd"

    def __init__(self, mappings: SharedMappings, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 dst_ids: Sequence[int], layout: KVLayout, host: str, port: int) -> None:
        self._mappings = mappings
        self._layers = layers
        self._dst_ids = list(dst_ids)
        self._layout = layout
        self._server = (host, port)
        self._source: torch.Tensor | None = None

    def prepare(self, region: SharedRegion | CudaIpcRegion) -> bool:
        if not isinstance(region, SharedRegion):
            return False
        self._source = self._mappings.source(region, self._layout, *self._server)
        return self._source is not None

    def copy(self, src_block_ids: list[int]) -> int:
        assert self._source is not None, "prepare() first"
        return copy_blocks(self._source, src_block_ids, self._layers, self._dst_ids)
