"""What a KV tier below the device pool offers the tiered KV connector (backends/kv_connectors/tiers/connector.py):
host RAM, local disk, a shared store. A tier keeps whole blocks (K and V of every layer, the bytes of
`KVLayout.block_nbytes`) under their chained block hash (cache/block_hash.py), inside a namespace that
names the weights and config (their fingerprint, backends/worker/fingerprint.py), the dtype and the block
layout, so two models, or two revisions of one, never share a block.

Threads: `leading_hits` runs in the engine thread and must not wait on a disk (in-memory indexes;
a remote store answers with one bounded round trip); `get` runs in the loader thread, `put` in the
writer thread. A corrupt or missing block is a miss (`get` returns False and the tier forgets it),
never an exception.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Protocol

import crc32c
import numpy as np

from backends.kv_transfer.base import KVLayout

_MAGIC = b"SWKV"
_HEADER = struct.Struct("<4sHHQQI")   # magic, version, reserved, block hash, payload bytes, CRC-32C
_VERSION = 2     # 1 had zlib's CRC-32: 7x slower than CRC-32C's hardware instruction (3.8 against 26 GB/s here)
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True, slots=True)
class TierUsage:
    medium: str            # backends/core/block_events: CPU, DISK or STORE
    num_blocks: int        # blocks this tier holds (for a shared store: those this worker put, -1 if unknown)
    used_bytes: int
    capacity_bytes: int    # 0: unbounded or unknown


Borrowed = tuple[np.ndarray, Callable[[], None]]   # a block's bytes in place, and their release


class KVTier(Protocol):
    medium: str

    def leading_hits(self, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes`, from the first, this tier holds (engine thread)."""
        ...

    def get(self, block_hash: int, out: memoryview) -> bool:
        """Copy the block into `out` (block_nbytes); False: missing or corrupt (loader thread)."""
        ...

    def put(self, block_hash: int, data: memoryview) -> bool:
        """Keep a copy of the block; False: not kept (writer thread)."""
        ...

    def borrow(self, block_hash: int) -> Borrowed | None:
        """The block's bytes where the tier keeps them, for a copy straight into the cache, and what
        gives them back once it has landed; None: not held, or this tier only copies out (`get`)
        (loader thread)."""
        ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...


def leading_run(held: Container[int], block_hashes: Sequence[int]) -> int:
    """How many of `block_hashes`, from the first, are in `held` (a tier's index)."""
    n = 0
    for block_hash in block_hashes:
        if block_hash not in held:
            break
        n += 1
    return n


def namespace(weights_fingerprint: str, layout: KVLayout) -> str:
    """A short name for (the weights and config, dtype, block layout, frame format): blocks are shared only
    within one namespace, so files and store values of other weights or another format are never read (nor
    adopted). `weights_fingerprint`: backends/worker/fingerprint.model_fingerprint, not the model's name,
    which two revisions of a model can share."""
    ident = f"v{_VERSION}|{weights_fingerprint}|{layout.dtype.value}|{layout.num_layers}|{layout.block_size}|" \
            f"{layout.num_kv_heads}|{layout.head_dim}"
    return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()


def frame_header(block_hash: int, payload: memoryview | bytes) -> bytes:
    """What precedes a block's bytes in a disk file or store value: its hash, size and checksum."""
    return _HEADER.pack(_MAGIC, _VERSION, 0, block_hash, len(payload), crc32c.crc32c(payload))


def frame(block_hash: int, payload: memoryview | bytes) -> bytes:
    """The header and the payload in one value."""
    return frame_header(block_hash, payload) + bytes(payload)


def check_frame(block_hash: int, header: bytes | bytearray | memoryview, payload: bytes | memoryview) -> bool:
    """Whether `header` and `payload`, read apart, are a whole frame of `block_hash` that nothing corrupted."""
    if len(header) != HEADER_BYTES:
        return False
    magic, version, _, stored_hash, size, crc = _HEADER.unpack_from(header)
    return (magic == _MAGIC and version == _VERSION and stored_hash == block_hash and size == len(payload)
            and crc32c.crc32c(payload) == crc)


def unframe(block_hash: int, data: memoryview | bytes, out: memoryview) -> bool:
    """Check a framed block against its hash, size and checksum, copying the payload into `out`;
    False (out unspecified) when anything disagrees."""
    view = memoryview(data)
    if len(view) != HEADER_BYTES + len(out) or not check_frame(block_hash, view[:HEADER_BYTES], view[HEADER_BYTES:]):
        return False
    out[:] = view[HEADER_BYTES:]
    return True
