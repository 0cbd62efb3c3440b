"""The KV transfer contract: the `KVTransport` interface, the cache-side protocols it talks
through, the records that cross the prefill/decode boundary, and the one error type.

Transport-neutral: no sockets, no torch, no engine imports. TCP lives in `tcp*.py`; another
transport (NIXL, Mooncake, NCCL) implements `KVTransport` against the same protocols.
"""
from __future__ import annotations

import abc
import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.core.kv_transfer_params import RemoteBlocks


class KVDtype(str, enum.Enum):
    """Element type of the KV cache; the wire names are these values."""
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {KVDtype.FLOAT32: 4, KVDtype.FLOAT16: 2, KVDtype.BFLOAT16: 2,
             KVDtype.FLOAT8_E4M3FN: 1, KVDtype.FLOAT8_E5M2: 1}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One worker's paged KV cache: its shape, and the weights whose KV it holds. Both ends of a transfer must
    agree on all of it."""
    num_layers: int      # attention layers, each with a K and a V tensor
    block_size: int      # tokens per block
    num_kv_heads: int    # KV heads held by this worker (after any tensor-parallel split)
    head_dim: int        # elements per head
    dtype: KVDtype       # element type of K and V
    # backends/worker/fingerprint.model_fingerprint of the weights that compute this KV. "": not known (a peer
    # from before it was sent); then it is not compared, as before.
    weights: str = ""

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of K (or of V) in one layer: [block_size, num_kv_heads, head_dim]."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def layer_nbytes(self, num_blocks: int) -> int:
        """Payload bytes of one layer of `num_blocks` blocks: all K blocks, then all V blocks."""
        return 2 * num_blocks * self.block_nbytes

    def mismatch(self, other: KVLayout) -> str | None:
        """A human-readable list of the fields that differ (this side first), or None if equal. The weights
        count only where both sides know theirs."""
        mine, theirs = self.to_wire(), other.to_wire()
        if not (self.weights and other.weights):
            mine.pop("weights", None)
        diffs = [f"{name}: {mine[name]} here vs {theirs[name]} at the peer" for name in mine
                 if mine[name] != theirs[name]]
        return "; ".join(diffs) or None

    def to_wire(self) -> dict[str, Any]:
        wire = {"num_layers": self.num_layers, "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype.value}
        if self.weights:
            wire["weights"] = self.weights
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> KVLayout:
        """Parse the wire form; raises ValueError on a missing, mistyped or unknown field."""
        try:
            ints = [data[k] for k in ("num_layers", "block_size", "num_kv_heads", "head_dim")]
            dtype = KVDtype(data["dtype"])
            weights = data.get("weights", "")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad KV layout {data!r}: {exc}") from None
        if not all(type(v) is int and v > 0 for v in ints):
            raise ValueError(f"bad KV layout {data!r}: sizes must be positive integers")
        if type(weights) is not str:
            raise ValueError(f"bad KV layout {data!r}: weights must be a string")
        num_layers, block_size, num_kv_heads, head_dim = ints
        return cls(num_layers, block_size, num_kv_heads, head_dim, dtype, weights)


class ChecksumKind(str, enum.Enum):
    """Per-layer payload checksum; TCP already checksums segments, so this guards the rest."""
    NONE = "none"
    CRC32C = "crc32c"      # CRC-32C (Castagnoli, hardware-accelerated) over K then V, zero-extended
    CRC32 = "crc32"        # zlib's CRC-32 (IEEE) over K then V bytes, zero-extended to 64 bits
    BLAKE2B = "blake2b"    # blake2b with an 8-byte digest, read as a little-endian u64


class ReleaseMode(str, enum.Enum):
    """Who frees the prefill worker's held blocks once they have been pulled."""
    AFTER_PULL = "after_pull"  # the client sends RELEASE once every layer landed and verified
    ON_SEND = "on_send"        # the server releases after writing the last layer (saves a round trip)
    NEVER = "never"            # neither; the caller releases explicitly (or the hold times out)


class KVErrorCode(str, enum.Enum):
    """Why a transfer failed; the first four, and `unauthorized`, also travel in ERROR frames."""
    UNKNOWN_TRANSFER = "unknown_transfer"   # no blocks held under that id (never, released, expired)
    LAYOUT_MISMATCH = "layout_mismatch"     # the two caches differ in shape, dtype or weights
    BAD_REQUEST = "bad_request"             # malformed request or block range
    INTERNAL = "internal"                   # the peer failed while serving
    PROTOCOL = "protocol"                   # bad magic/version, unexpected or oversized frame
    CHECKSUM_MISMATCH = "checksum_mismatch" # a layer's bytes differ from what the sender summed
    PEER_CLOSED = "peer_closed"             # the connection ended before the transfer did
    CONNECT_FAILED = "connect_failed"       # could not reach the peer
    TIMEOUT = "timeout"                     # connect, idle or total time limit passed
    UNAUTHORIZED = "unauthorized"           # a keyed listener's peer did not prove the pool's key (auth.py)


class KVTransferError(Exception):
    """A transfer failed; `code` says why. Destination blocks may hold partial data."""

    def __init__(self, code: KVErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Knobs of one transport; every wait has a limit."""
    connect_timeout_s: float = 5.0    # TCP connect to the peer
    idle_timeout_s: float = 10.0      # longest stretch with no bytes arriving (or leaving)
    total_timeout_s: float = 300.0    # one pull, connect to last byte
    checksum: ChecksumKind = ChecksumKind.CRC32C  # what the client asks the server to compute (TCP only)
    release: ReleaseMode = ReleaseMode.AFTER_PULL  # what the client asks for
    shared_memory: bool = True        # copy from the server's cache directly on one host (memfd) or GPU (CUDA IPC)
    key: bytes | None = field(default=None, repr=False)  # the pool's shared key (auth.py); None: no handshake


def prefill_kv_transfer_params(engine_id: str, host: str, port: int, transfer_id: str,
                               block_ids: Sequence[int]) -> dict[str, Any]:
    """What a prefill worker answers in `kv_transfer_params` (vLLM's field names)."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine_id,
            "remote_host": host, "remote_port": port, "remote_block_ids": list(block_ids),
            "remote_request_id": transfer_id}


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """Where a cache lies in shared memory, as the server's BEGIN announces it."""
    path: str          # the file
    nonce: str         # 32 hex digits, also at the start of the file: proves the mapping is this cache
    offset: int        # byte offset of the cache, laid out [num_layers, 2 (K, V), num_blocks, block bytes]
    num_blocks: int    # blocks per layer in that cache (the server's count)

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "nonce": self.nonce, "offset": self.offset, "num_blocks": self.num_blocks}

    @classmethod
    def from_wire(cls, data: Any) -> SharedRegion:
        """Raises ValueError on a missing or mistyped field."""
        if not isinstance(data, Mapping):
            raise ValueError("shared-memory region is not an object")
        path, nonce, offset, num_blocks = (data.get(k) for k in ("path", "nonce", "offset", "num_blocks"))
        if not (isinstance(path, str) and isinstance(nonce, str) and re.fullmatch(r"[0-9a-f]{32}", nonce)
                and type(offset) is int and offset >= 0 and type(num_blocks) is int and num_blocks > 0):
            raise ValueError(f"bad shared-memory region {dict(data)!r}")
        return cls(path, nonce, offset, num_blocks)


@dataclass(frozen=True, slots=True)
class CudaIpcRegion:
    """Where a CUDA cache lies, as the server's BEGIN announces it to a client on the same GPU: the fields of
    torch's CUDA sharing (torch.multiprocessing.reductions), bytes as hex (cuda_ipc.py)."""
    device_uuid: str           # the GPU, the same in every process
    pid: int                   # the exporting process (which cannot open its own handle)
    handle: str                # cudaIpcMemHandle of the allocation holding the cache
    storage_nbytes: int        # bytes of the storage the cache's view lies in
    storage_offset: int        # that storage's byte offset in the allocation
    tensor_offset: int         # the cache's byte offset in that storage, laid out [layers, 2, blocks, block bytes]
    ref_counter_handle: str    # the exporter's shared reference counter for this offer
    ref_counter_offset: int
    event_handle: str          # an IPC event the first opening waits on ("" for none)
    event_sync_required: bool
    num_blocks: int            # blocks per layer in that cache (the server's count)

    KIND = "cuda_ipc"

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.KIND, **{name: getattr(self, name) for name in _CUDA_FIELDS}}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CudaIpcRegion:
        """Raises ValueError on a missing or mistyped field."""
        values: dict[str, Any] = {name: data.get(name) for name in _CUDA_FIELDS}
        for name, kind in _CUDA_FIELDS.items():
            value = values[name]
            if type(value) is not kind or (type(value) is int and value < 0):
                raise ValueError(f"bad CUDA IPC region: {name}={value!r}")
            if isinstance(value, str) and name != "device_uuid" and not re.fullmatch(r"(?:[0-9a-f]{2})*", value):
                raise ValueError(f"bad CUDA IPC region: {name} is not hex")
        return cls(**values)


_CUDA_FIELDS = {"device_uuid": str, "pid": int, "handle": str, "storage_nbytes": int, "storage_offset": int,
                "tensor_offset": int, "ref_counter_handle": str, "ref_counter_offset": int, "event_handle": str,
                "event_sync_required": bool, "num_blocks": int}


def region_from_wire(data: Any) -> SharedRegion | CudaIpcRegion:
    """The region a BEGIN names: a shared-memory file (no "kind", as before) or a CUDA IPC export."""
    if isinstance(data, Mapping) and data.get("kind") == CudaIpcRegion.KIND:
        return CudaIpcRegion.from_wire(data)
    return SharedRegion.from_wire(data)


@dataclass(frozen=True, slots=True)
class PullResult:
    """What one successful pull moved."""
    transfer_id: str     # the remote hold
    num_blocks: int      # blocks written into the local cache
    num_bytes: int       # payload bytes received (all layers, K and V)
    elapsed_s: float     # connect to last byte (and RELEASED, if the client released)
    released: bool       # whether the remote hold is gone now
    shared_memory: bool = False  # copied from the server's cache directly (shared memory or CUDA IPC), not streamed
    cuda_ipc: bool = False       # that copy was device to device, through CUDA IPC


class KVLayerReader(Protocol):
    """Read access to one transfer's blocks, layer by layer (prefill side)."""

    def read_layer(self, layer: int) -> Sequence[memoryview]:
        """The layer's payload as contiguous pieces: K of every block in order, then V likewise.

        Valid until the next `read_layer` or `close`; the transport sends them before either.
        """
        ...

    def close(self) -> None: ...


class KVBlockSource(Protocol):
    """A prefill worker's cache as the transport sees it: held blocks, read-only."""

    def layout(self) -> KVLayout: ...

    def lookup(self, transfer_id: str) -> Sequence[int] | None:
        """Block ids held under `transfer_id`, in sequence order; None if unknown or expired."""
        ...

    def reader(self, block_ids: Sequence[int], max_pieces: int) -> KVLayerReader:
        """A reader over these blocks, whose layers come in at most `max_pieces` pieces (>= 2:
        more lets a scatter-gather transport send blocks in place instead of gathering them).
        The source keeps the blocks unchanged until the reader is closed."""
        ...

    def release(self, transfer_id: str) -> bool:
        """Drop the hold; False if there was none."""
        ...

    def shared_region(self) -> SharedRegion | CudaIpcRegion | None:
        """Where the cache lies in shared memory or GPU memory another process can open, laid out
        [layers, 2, blocks, block bytes]; None if neither (a reader over the blocks then only pins them
        while a client copies)."""
        ...


class KVLayerWriter(Protocol):
    """Write access to the local blocks one transfer fills, layer by layer (decode side)."""

    def layer_buffer(self, layer: int) -> Sequence[memoryview]:
        """Writable landing pieces for this layer's payload (K of every block, then V), in order.

        Each piece costs the transport at least one receive call, so a sink hands out few.
        """
        ...

    def commit_layer(self, layer: int) -> None:
        """The layer's bytes have landed (and were verified): place them in the cache."""
        ...

    def close(self) -> None:
        """Finish (wait for any device copies) and give back staging memory."""
        ...


class KVBlockSink(Protocol):
    """A decode worker's cache as the transport sees it: blocks it allocated for a pull."""

    def layout(self) -> KVLayout: ...

    def writer(self, block_ids: Sequence[int]) -> KVLayerWriter:
        """A writer into these local blocks (raises ValueError for ids outside the cache)."""
        ...


class KVTransport(abc.ABC):
    """One per worker: a prefill worker serves its held blocks, a decode worker pulls them.
    (The engine-side `KVConnector` in backends/kv_connectors/base.py drives it.)"""

    @abc.abstractmethod
    async def serve(self, source: KVBlockSource, host: str, port: int) -> tuple[str, int]:
        """Start answering pulls for `source`; returns the bound (host, port) (port 0: any)."""

    @abc.abstractmethod
    async def pull(self, remote: RemoteBlocks, sink: KVBlockSink,
                   block_ids: Sequence[int], start_block: int = 0) -> PullResult:
        """Copy the remote hold's blocks [start_block:] into local `block_ids` (same count).

        Raises KVTransferError; on error the local blocks hold partial data and the remote hold
        is kept, so the caller may retry or release it.
        """

    @abc.abstractmethod
    async def release(self, remote: RemoteBlocks) -> bool:
        """Ask the prefill worker to drop the hold; False if it was unknown or expired."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving and end open connections."""
