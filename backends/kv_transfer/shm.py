"""Same-host KV transfer through shared memory: a prefill worker's paged KV cache lives in a memfd,
a decode worker on the same host maps it read-only and copies held blocks straight into its own
cache: one memcpy per run of blocks instead of a trip through loopback TCP.

The TCP connection still carries the control frames (PULL, BEGIN, COPIED, DONE) and keeps the
blocks pinned while they are copied (docs/kv_transfer.md, "Shared memory").
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from backends.kv_transfer.base import KVLayout, SharedRegion

log = logging.getLogger(__name__)

REGION_MAGIC = b"SYKVSHM1"
HEADER_BYTES = 4096                 # the magic and nonce, then the cache, page-aligned


class SharedKVFile:
    """A zero-filled anonymous shared-memory file (memfd) holding a whole paged cache.

    Other processes of the same user open it as /proc/<pid>/fd/<fd>, so it has no name to leak: the
    memory goes when this process and every mapping of it are gone, even after a SIGKILL.
    `tensor` is [num_layers, 2, num_blocks, *block_shape] of `dtype`; layer i's K is tensor[i, 0].
    """

    def __init__(self, num_layers: int, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype) -> None:
        nonce = secrets.token_hex(16)
        shape = (num_layers, 2, num_blocks, *block_shape)
        nbytes = HEADER_BYTES + int(np.prod(shape)) * dtype.itemsize
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


def stacked_bytes(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray | None:
    """A [num_layers, 2, num_blocks, block bytes] uint8 view of CPU caches laid out as one buffer in
    that order (SharedKVFile's and KVCache's are), else None."""
    k0 = layers[0][0]
    if k0.device.type != "cpu":
        return None
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
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, flat.storage_offset(),
                                                   (len(layers), 2, num_blocks, block_bytes))
    return whole.numpy()


def layer_bytes(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, [num_blocks, block bytes] uint8 views of K and V (contiguous CPU tensors)."""
    return [tuple(t.view(torch.uint8).view(t.shape[0], -1).numpy() for t in pair)  # type: ignore[misc]
            for pair in layers]


def joint_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, length) of the runs where both id lists ascend by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class SharedMappings:
    """The decode side's read-only mappings of prefill caches, by path; one per connector."""

    def __init__(self) -> None:
        self._maps: dict[tuple[str, str], tuple[mmap.mmap, np.ndarray]] = {}
        self._refused: set[tuple[str, int]] = set()   # (host, port) whose region could not be mapped

    def wanted(self, host: str, port: int) -> bool:
        """Whether to ask this server for shared memory (not after its region failed to map once)."""
        return (host, port) not in self._refused

    def source(self, region: SharedRegion, layout: KVLayout, host: str, port: int) -> np.ndarray | None:
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
            try:
                mapping.close()
            except BufferError:
                pass   # a copy still holds a view; the mapping goes when it does
        self._maps.clear()


def _map_region(region: SharedRegion, layout: KVLayout) -> tuple[mmap.mmap, np.ndarray] | None:
    need = region.offset + 2 * layout.num_layers * region.num_blocks * layout.block_nbytes
    try:
        with open(region.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < need:
                log.info("shared KV region %s is smaller than announced", region.path)
                return None
            mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    except OSError as exc:
        log.info("shared KV region %s not usable here (%s); pulling over TCP", region.path, exc)
        return None
    if mapping[:len(REGION_MAGIC) + 16] != REGION_MAGIC + bytes.fromhex(region.nonce):
        log.info("shared KV region %s belongs to another cache; pulling over TCP", region.path)
        mapping.close()
        return None
    view = np.frombuffer(mapping, np.uint8, count=need - region.offset, offset=region.offset)
    return mapping, view.reshape(layout.num_layers, 2, region.num_blocks, layout.block_nbytes)


def copy_blocks(source: np.ndarray, src_ids: Sequence[int], sink_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                dst_ids: Sequence[int]) -> int:
    """Copy blocks src_ids of a mapped region into dst_ids of a CPU cache, every layer's K and V;
    returns the bytes copied. numpy releases the GIL for each copy, so this runs well in a thread."""
    runs = joint_runs(src_ids, dst_ids)
    stacked = stacked_bytes(sink_layers)
    if stacked is not None:
        for s, d, n in runs:
            stacked[:, :, d:d + n] = source[:, :, s:s + n]
    else:
        for layer, (k, v) in enumerate(layer_bytes(sink_layers)):
            for s, d, n in runs:
                k[d:d + n] = source[layer, 0, s:s + n]
                v[d:d + n] = source[layer, 1, s:s + n]
    return source.shape[0] * 2 * len(dst_ids) * source.shape[3]


class SharedPull:
    """One pull's shared-memory path (tcp_client.SharedCopier): map the server's region, copy the
    announced blocks into local `dst_ids` of a CPU cache."""

    def __init__(self, mappings: SharedMappings, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 dst_ids: Sequence[int], layout: KVLayout, host: str, port: int) -> None:
        self._mappings = mappings
        self._layers = layers
        self._dst_ids = list(dst_ids)
        self._layout = layout
        self._server = (host, port)
        self._source: np.ndarray | None = None

    def prepare(self, region: SharedRegion) -> bool:
        self._source = self._mappings.source(region, self._layout, *self._server)
        return self._source is not None

    def copy(self, src_block_ids: list[int]) -> int:
        assert self._source is not None, "prepare() first"
        return copy_blocks(self._source, src_block_ids, self._layers, self._dst_ids)
