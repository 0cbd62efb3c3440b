"""The KV listener's shared-key handshake: a keyed server opens each connection with CHALLENGE {nonce}, and the
client answers AUTH {proof = HMAC-SHA256(key, context || nonce)} before any request. The key never crosses the
wire, and a recorded AUTH answers no other connection's nonce. Frames and digests only: no sockets are opened here.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any

from backends.kv_transfer.base import KVErrorCode, KVTransferError
from backends.kv_transfer.protocol import (
    HEADER_SIZE,
    FrameType,
    decode_error,
    decode_header,
    decode_json_meta,
    encode_json_frame,
)

ENV_VAR = "SWITCHYARD_KV_KEY"         # where workers read --kv-key from (backends/server/__main__.py)
SCHEME = "hmac-sha256-v1"             # names the proof's definition; a new one gets a new name
_CONTEXT = b"switchyard-kv-auth-v1\x00"  # domain separation: this key's MACs prove nothing anywhere else
NONCE_BYTES = 32


def key_from_text(text: str | None) -> bytes | None:
    """The key as the transport takes it ("" and None: no key, as for the worker's API key)."""
    return text.encode() if text else None


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, _CONTEXT + nonce, hashlib.sha256).digest()


def verify(key: bytes, nonce: bytes, meta: Mapping[str, Any]) -> bool:
    """Whether AUTH's metadata proves `key` for this nonce (in constant time for well-formed proofs)."""
    given = meta.get("proof")
    if not isinstance(given, str):
        return False
    try:
        raw = bytes.fromhex(given)
    except ValueError:
        return False
    return hmac.compare_digest(raw, proof(key, nonce))


def challenge_frame(nonce: bytes) -> bytes:
    return encode_json_frame(FrameType.CHALLENGE, {"scheme": SCHEME, "nonce": nonce.hex()})


def missing_key() -> KVTransferError:
    """What a client without a key makes of a CHALLENGE."""
    return KVTransferError(KVErrorCode.UNAUTHORIZED, "the KV listener asks for the pool's key and this worker has "
                                                     f"none (--kv-key or ${ENV_VAR})")


def auth_frame(key: bytes | None, challenge: Mapping[str, Any]) -> bytes:
    """The AUTH answering a CHALLENGE's metadata; UNAUTHORIZED where this side has no key."""
    if key is None:
        raise missing_key()
    nonce = challenge.get("nonce")
    if challenge.get("scheme") != SCHEME or not isinstance(nonce, str):
        raise KVTransferError(KVErrorCode.PROTOCOL, f"CHALLENGE of an unknown scheme {challenge.get('scheme')!r}")
    try:
        raw = bytes.fromhex(nonce)
    except ValueError:
        raise KVTransferError(KVErrorCode.PROTOCOL, "CHALLENGE nonce is not hex") from None
    if len(raw) != NONCE_BYTES:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"CHALLENGE nonce of {len(raw)} bytes, not {NONCE_BYTES}")
    return encode_json_frame(FrameType.AUTH, {"proof": proof(key, raw).hex()})


async def answer_challenge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
    """The client's half over streams (RELEASE's own connection): read CHALLENGE, send AUTH."""
    header = decode_header(await reader.readexactly(HEADER_SIZE))
    meta = decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))
    if header.frame_type is FrameType.ERROR:
        raise decode_error(meta)
    if header.frame_type is not FrameType.CHALLENGE:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"{header.frame_type.name} frame where a keyed listener "
                                                    "sends CHALLENGE (has the listener the pool's key?)")
    writer.write(auth_frame(key, meta))
