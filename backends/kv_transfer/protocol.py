"""Frame encoding of switchyard's KV transfer protocol (docs/kv_transfer.md is the spec).

Pure bytes in, bytes out: no sockets, no torch. All integers are little-endian.
"""
from __future__ import annotations

import enum
import hashlib
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import orjson

from backends.kv_transfer.base import ChecksumKind, KVErrorCode, KVLayout, KVTransferError, ReleaseMode

MAGIC = b"SYKV"
VERSION = 1
# magic[4], version u8, frame type u8, flags u16, meta_len u32, payload_len u64
_HEADER = struct.Struct("<4sBBHIQ")
HEADER_SIZE = _HEADER.size  # 20
# LAYER metadata: layer index u32, reserved u32 (zero), checksum u64
_LAYER_META = struct.Struct("<IIQ")
LAYER_META_SIZE = _LAYER_META.size  # 16
MAX_META_LEN = 64 * 1024


class FrameType(enum.IntEnum):
    PULL = 1      # client -> server: JSON PullRequest
    BEGIN = 2     # server -> client: JSON {transfer_id, layout, num_blocks, checksum}
    LAYER = 3     # server -> client: binary LAYER meta, payload = K blocks then V blocks
    DONE = 4      # server -> client: JSON {transfer_id, released}
    RELEASE = 5   # client -> server: JSON {transfer_id}
    RELEASED = 6  # server -> client: JSON {transfer_id, released}
    ERROR = 7     # server -> client: JSON {code, message}
    COPIED = 8    # client -> server: JSON {transfer_id, release}: copied from shared memory
    STREAM = 9    # client -> server: JSON {transfer_id}: cannot map the shared memory, send LAYERs
    CHALLENGE = 10  # server -> client, first, where the listener has a key: JSON {scheme, nonce} (auth.py)
    AUTH = 11       # client -> server: JSON {proof}: HMAC of the nonce under the pool's key


@dataclass(frozen=True, slots=True)
class FrameHeader:
    frame_type: FrameType  # what follows
    meta_len: int          # bytes of metadata right after the header
    payload_len: int       # raw bytes right after the metadata (LAYER only)


@dataclass(frozen=True, slots=True)
class PullRequest:
    """The PULL frame's metadata: which hold to send, how, and what the client's cache is."""
    transfer_id: str           # hold id on the server
    layout: KVLayout           # the client's cache layout; the server refuses any difference
    checksum: ChecksumKind     # per-layer checksum the server computes
    release: ReleaseMode       # ON_SEND: server releases after the last layer
    start_block: int           # skip the hold's first blocks (the client has them cached)
    num_blocks: int            # blocks the client expects from start_block on
    shared_memory: bool = False  # the client can copy from the server's shared-memory cache
    cuda_ipc: bool = False       # the client can open the server's CUDA cache (same GPU) and copy from it

    def to_wire(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "layout": self.layout.to_wire(),
                "checksum": self.checksum.value, "release": self.release.value,
                "start_block": self.start_block, "num_blocks": self.num_blocks,
                "shared_memory": self.shared_memory, "cuda_ipc": self.cuda_ipc}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> PullRequest:
        """Raises ValueError naming the bad field."""
        try:
            req = cls(transfer_id=data["transfer_id"], layout=KVLayout.from_wire(data["layout"]),
                      checksum=ChecksumKind(data.get("checksum", "none")),
                      release=ReleaseMode(data.get("release", "after_pull")),
                      start_block=data.get("start_block", 0), num_blocks=data["num_blocks"],
                      shared_memory=data.get("shared_memory", False), cuda_ipc=data.get("cuda_ipc", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad PULL request: {exc!s}") from None
        if not isinstance(req.transfer_id, str) or not req.transfer_id:
            raise ValueError("bad PULL request: transfer_id must be a non-empty string")
        for flag in ("shared_memory", "cuda_ipc"):
            if type(getattr(req, flag)) is not bool:
                raise ValueError(f"bad PULL request: {flag} must be a boolean")
        for name in ("start_block", "num_blocks"):
            value = getattr(req, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"bad PULL request: {name} must be a non-negative integer")
        return req


def encode_header(frame_type: FrameType, meta_len: int, payload_len: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, frame_type, 0, meta_len, payload_len)


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and validate a header; raises KVTransferError(PROTOCOL) on anything off."""
    if len(data) != HEADER_SIZE:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"header is {len(data)} bytes, not {HEADER_SIZE}")
    magic, version, ftype, _flags, meta_len, payload_len = _HEADER.unpack(data)
    if magic != MAGIC:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"bad magic {bytes(magic)!r} (not a KV transfer peer?)")
    if version != VERSION:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"protocol version {version}, this side speaks {VERSION}")
    try:
        frame_type = FrameType(ftype)
    except ValueError:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"unknown frame type {ftype}") from None
    if meta_len > MAX_META_LEN:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"metadata of {meta_len} bytes exceeds {MAX_META_LEN}")
    if payload_len and frame_type is not FrameType.LAYER:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"{frame_type.name} frame with a payload")
    return FrameHeader(frame_type, meta_len, payload_len)


def encode_json_frame(frame_type: FrameType, meta: Mapping[str, Any]) -> bytes:
    """A whole frame whose metadata is a JSON object and which has no payload."""
    body = orjson.dumps(meta)
    return encode_header(frame_type, len(body)) + body


def decode_json_meta(frame_type: FrameType, data: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        meta = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"{frame_type.name} metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise KVTransferError(KVErrorCode.PROTOCOL, f"{frame_type.name} metadata is not a JSON object")
    return meta


def encode_error(code: KVErrorCode, message: str) -> bytes:
    return encode_json_frame(FrameType.ERROR, {"code": code.value, "message": message})


def decode_error(meta: Mapping[str, Any]) -> KVTransferError:
    """The local exception for a received ERROR frame (unknown codes become INTERNAL)."""
    try:
        code = KVErrorCode(meta.get("code"))
    except ValueError:
        code = KVErrorCode.INTERNAL
    return KVTransferError(code, f"peer says: {meta.get('message', '')}")


def encode_layer_prefix(layer: int, checksum: int, payload_len: int) -> bytes:
    """Header plus LAYER metadata; the K and V payload bytes follow as they are."""
    return encode_header(FrameType.LAYER, LAYER_META_SIZE, payload_len) + _LAYER_META.pack(layer, 0, checksum)


def decode_layer_meta(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(layer index, checksum) of a LAYER frame."""
    if len(data) != LAYER_META_SIZE:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"LAYER metadata is {len(data)} bytes, not {LAYER_META_SIZE}")
    layer, _reserved, checksum = _LAYER_META.unpack(data)
    return layer, checksum


def layer_checksum(kind: ChecksumKind, views: Sequence[memoryview]) -> int:
    """Checksum of the concatenation of `views` (K then V), as the u64 the LAYER frame carries."""
    if kind is ChecksumKind.NONE:
        return 0
    if kind is ChecksumKind.CRC32C:
        crc = 0
        for view in views:
            crc = crc32c.crc32c(view, value=crc)
        return crc
    if kind is ChecksumKind.CRC32:
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        return crc
    digest = hashlib.blake2b(digest_size=8)
    for view in views:
        digest.update(view)
    return int.from_bytes(digest.digest(), "little")
