"""The decode worker's RELEASE on a connection of its own (after a pull that did not release, or for a hold it
will never pull), proving the pool's key first where it has one."""
from __future__ import annotations

import asyncio

from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer import auth
from backends.kv_transfer.base import KVErrorCode, KVTransferConfig, KVTransferError
from backends.kv_transfer.protocol import (
    HEADER_SIZE,
    FrameType,
    decode_error,
    decode_header,
    decode_json_meta,
    encode_json_frame,
)


async def release_blocks(remote: RemoteBlocks, config: KVTransferConfig) -> bool:
    """Send RELEASE on a fresh connection; True if the server dropped a hold."""
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            reader, writer = await asyncio.open_connection(remote.host, remote.port)
    except TimeoutError:
        raise KVTransferError(KVErrorCode.TIMEOUT, f"connect to {remote.host}:{remote.port} timed out") from None
    except OSError as exc:
        raise KVTransferError(KVErrorCode.CONNECT_FAILED, f"{remote.host}:{remote.port}: {exc}") from None
    try:
        async with asyncio.timeout(config.idle_timeout_s):
            if config.key is not None:
                await auth.answer_challenge(reader, writer, config.key)
            writer.write(encode_json_frame(FrameType.RELEASE, {"transfer_id": remote.transfer_id}))
            header = decode_header(await reader.readexactly(HEADER_SIZE))
            meta = decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))
    except TimeoutError:
        raise KVTransferError(KVErrorCode.TIMEOUT, "no RELEASED answer in time") from None
    except (asyncio.IncompleteReadError, ConnectionError):
        raise KVTransferError(KVErrorCode.PEER_CLOSED, "connection closed before RELEASED") from None
    finally:
        writer.close()
    if header.frame_type is FrameType.ERROR:
        raise decode_error(meta)
    if header.frame_type is FrameType.CHALLENGE:
        raise auth.missing_key()
    if header.frame_type is not FrameType.RELEASED:
        raise KVTransferError(KVErrorCode.PROTOCOL, f"unexpected {header.frame_type.name} frame after RELEASE")
    return meta.get("released") is True
