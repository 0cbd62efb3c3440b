"""The prefill worker's KV listener: answers PULL and RELEASE frames over asyncio streams, after the pool's key
is proven where it has one (auth.py).

Sends each layer's bytes as memoryviews of the source's buffers (`write`, or one `writelines`
= writev under uvloop), never through `bytes` copies. Frees blocks only on RELEASE or a PULL
that asked for ON_SEND.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence

from backends.kv_transfer import auth
from backends.kv_transfer.base import (
    CudaIpcRegion,
    KVBlockSource,
    KVErrorCode,
    KVTransferConfig,
    KVTransferError,
    ReleaseMode,
    SharedRegion,
)
from backends.kv_transfer.protocol import (
    HEADER_SIZE,
    FrameType,
    PullRequest,
    decode_header,
    decode_json_meta,
    encode_error,
    encode_json_frame,
    encode_layer_prefix,
    layer_checksum,
)

log = logging.getLogger(__name__)
_MAX_IOV = 1024  # pieces per layer a scatter-gather write takes (Linux IOV_MAX; libuv splits beyond)
_MAX_WARNED_PEERS = 1024  # refused peers logged at warning level once each; more are logged at info

RefusalHook = Callable[[str], None]   # called with "missing" or "wrong" for each connection refused


class TcpKVServer:
    """One listener per prefill worker; one task per connection, requests in order on each."""

    def __init__(self, source: KVBlockSource, config: KVTransferConfig, on_refused: RefusalHook | None = None) -> None:
        self._source = source
        self._config = config
        self._on_refused = on_refused
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._warned_peers: set[str] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._on_connection, host, port)
        bound = self._server.sockets[0].getsockname()
        if self._config.key is None and not all(ipaddress.ip_address(s.getsockname()[0]).is_loopback
                                                for s in self._server.sockets):
            log.warning("KV transfer listener on %s:%d has no key: anyone who reaches it can read and release held "
                        "KV (set --kv-key or $%s on every worker of the pool)", bound[0], bound[1], auth.ENV_VAR)
        return bound[0], bound[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Our own task (not the one start_server would make) so close() can cancel it cleanly.
        task = asyncio.get_running_loop().create_task(self._handle(reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # drain() then waits until the transport holds nothing, so a reader's staging buffer
        # is never overwritten while bytes from it are still queued.
        writer.transport.set_write_buffer_limits(high=0)
        try:
            if self._config.key is not None and not await self._authenticate(reader, writer, peer):
                return
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
            log.info("KV connection from %s ended: %r", peer, exc)
        except KVTransferError as exc:
            log.warning("KV connection from %s: %s", peer, exc)
            await _send_quietly(writer, encode_error(exc.code, exc.message))
        except Exception:  # the connection boundary: log, tell the peer, keep serving others
            log.exception("KV connection from %s failed", peer)
            await _send_quietly(writer, encode_error(KVErrorCode.INTERNAL, "server error"))
        finally:
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # a peer that stopped reading must not pin the socket
            else:
                writer.close()

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object) -> bool:
        """CHALLENGE, then the client's AUTH must prove the key; anything else is refused before a request is read."""
        nonce = auth.new_nonce()
        writer.write(auth.challenge_frame(nonce))
        await self._drain(writer)
        reason = "missing"
        try:
            async with asyncio.timeout(self._config.idle_timeout_s):
                header = decode_header(await reader.readexactly(HEADER_SIZE))
                if header.frame_type is FrameType.AUTH:
                    meta = decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))
                    if auth.verify(self._config.key or b"", nonce, meta):
                        return True
                    reason = "wrong"
        except (KVTransferError, asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass   # a peer that sends no AUTH at all is refused like one that sends another frame
        self._refuse(peer, reason)
        await _send_quietly(writer, encode_error(KVErrorCode.UNAUTHORIZED, "this KV listener needs the pool's key"))
        return False

    def _refuse(self, peer: object, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)
        host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if host in self._warned_peers or len(self._warned_peers) >= _MAX_WARNED_PEERS:
            log.info("KV connection from %s refused: %s key", peer, reason)
            return
        self._warned_peers.add(host)
        log.warning("KV connection from %s refused: %s key (logged once per peer; counted in "
                    "switchyard_kv_transfer_refused_connections_total)", peer, reason)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer frames until the client closes; protocol errors end the connection."""
        while True:
            try:
                async with asyncio.timeout(self._config.idle_timeout_s):
                    raw = await reader.readexactly(HEADER_SIZE)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    return  # clean close between requests
                raise
            header = decode_header(raw)
            async with asyncio.timeout(self._config.idle_timeout_s):
                meta = decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))
            if header.frame_type is FrameType.PULL:
                await self._serve_pull(reader, writer, meta)
            elif header.frame_type is FrameType.RELEASE:
                await self._serve_release(writer, meta)
            else:
                raise KVTransferError(KVErrorCode.PROTOCOL, f"unexpected {header.frame_type.name} frame from a client")

    async def _serve_release(self, writer: asyncio.StreamWriter, meta: dict[str, object]) -> None:
        transfer_id = meta.get("transfer_id")
        if not isinstance(transfer_id, str):
            raise KVTransferError(KVErrorCode.PROTOCOL, "RELEASE without a transfer_id")
        released = self._source.release(transfer_id)
        writer.write(encode_json_frame(FrameType.RELEASED, {"transfer_id": transfer_id, "released": released}))
        await self._drain(writer)

    async def _serve_pull(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          meta: dict[str, object]) -> None:
        try:
            request = PullRequest.from_wire(meta)
            block_ids = self._admit(request)
        except ValueError as exc:
            error = KVTransferError(KVErrorCode.BAD_REQUEST, str(exc))
        except KVTransferError as exc:
            error = exc
        else:
            region = self._offered_region(request)
            if region is None or not await self._offer_shared(reader, writer, request, block_ids, region):
                await self._send_blocks(writer, request, block_ids)
            return
        # Refusals leave the connection usable for the next request.
        log.info("KV pull refused: %s", error)
        writer.write(encode_error(error.code, error.message))
        await self._drain(writer)

    def _offered_region(self, request: PullRequest) -> SharedRegion | CudaIpcRegion | None:
        """The cache's region, where the client can use its kind (CUDA IPC only where this side allows copies)."""
        if not (request.shared_memory or request.cuda_ipc):
            return None
        region = self._source.shared_region()
        if isinstance(region, CudaIpcRegion):
            return region if request.cuda_ipc and self._config.shared_memory else None
        return region if request.shared_memory else None

    def _admit(self, request: PullRequest) -> Sequence[int]:
        """The hold's blocks to send, or a KVTransferError saying why not."""
        layout = self._source.layout()
        diff = layout.mismatch(request.layout)
        if diff is not None:
            raise KVTransferError(KVErrorCode.LAYOUT_MISMATCH, f"KV cache layouts differ: {diff}")
        held = self._source.lookup(request.transfer_id)
        if held is None:
            raise KVTransferError(KVErrorCode.UNKNOWN_TRANSFER,
                                  f"no blocks held under transfer id {request.transfer_id!r} (unknown or expired)")
        stop = request.start_block + request.num_blocks
        if stop != len(held):
            raise KVTransferError(KVErrorCode.BAD_REQUEST,
                                  f"hold has {len(held)} blocks; the client asked for [{request.start_block}:{stop}]")
        return held[request.start_block:stop]

    def _begin(self, request: PullRequest, num_blocks: int, **extra: object) -> bytes:
        return encode_json_frame(FrameType.BEGIN, {
            "transfer_id": request.transfer_id, "layout": self._source.layout().to_wire(),
            "num_blocks": num_blocks, "checksum": request.checksum.value, **extra})

    async def _offer_shared(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: PullRequest,
                            block_ids: Sequence[int], region: SharedRegion | CudaIpcRegion) -> bool:
        """BEGIN naming the shared-memory region and the blocks, which stay pinned until the client
        says COPIED (then DONE; True) or STREAM (False: the caller sends LAYER frames)."""
        pin = self._source.reader(block_ids, 2 * len(block_ids) + 2)   # enough pieces: never staged
        try:
            writer.write(self._begin(request, len(block_ids), shared_memory=region.to_wire(),
                                     block_ids=list(block_ids)))
            await self._drain(writer)
            async with asyncio.timeout(self._config.idle_timeout_s):
                header = decode_header(await reader.readexactly(HEADER_SIZE))
                meta = decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))
        finally:
            pin.close()
        if meta.get("transfer_id") != request.transfer_id:
            raise KVTransferError(KVErrorCode.PROTOCOL, f"{header.frame_type.name} for another transfer")
        if header.frame_type is FrameType.STREAM:
            return False
        if header.frame_type is not FrameType.COPIED:
            raise KVTransferError(KVErrorCode.PROTOCOL, f"unexpected {header.frame_type.name} frame after a "
                                                        "shared-memory BEGIN")
        released = meta.get("release") is True and self._source.release(request.transfer_id)
        writer.write(encode_json_frame(FrameType.DONE, {"transfer_id": request.transfer_id, "released": released}))
        await self._drain(writer)
        return True

    async def _send_blocks(self, writer: asyncio.StreamWriter, request: PullRequest,
                           block_ids: Sequence[int]) -> None:
        layout = self._source.layout()
        writer.write(self._begin(request, len(block_ids)))
        payload_len = layout.layer_nbytes(len(block_ids))
        # uvloop's writelines is one writev of the caller's buffers; asyncio's joins them (a copy),
        # so there the source gathers each layer into K and V pieces itself.
        scatter_gather = type(writer.transport).__module__.startswith("uvloop")
        reader = self._source.reader(block_ids, _MAX_IOV if scatter_gather else 2)
        try:
            for layer in range(layout.num_layers):
                pieces = reader.read_layer(layer)
                if sum(len(p) for p in pieces) != payload_len:
                    raise KVTransferError(KVErrorCode.INTERNAL, f"source gave a wrong-sized layer {layer}")
                checksum = layer_checksum(request.checksum, pieces)
                writer.write(encode_layer_prefix(layer, checksum, payload_len))
                if scatter_gather:
                    writer.writelines(pieces)
                else:
                    for piece in pieces:
                        writer.write(piece)
                await self._drain(writer)
        finally:
            reader.close()
        released = request.release is ReleaseMode.ON_SEND and self._source.release(request.transfer_id)
        writer.write(encode_json_frame(FrameType.DONE, {"transfer_id": request.transfer_id, "released": released}))
        await self._drain(writer)

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        """Wait until the transport is empty; time out only when the peer stops taking bytes."""
        while True:
            queued = writer.transport.get_write_buffer_size()
            try:
                async with asyncio.timeout(self._config.idle_timeout_s):
                    await writer.drain()
                return
            except TimeoutError:
                if writer.transport.get_write_buffer_size() >= queued:
                    raise


async def _send_quietly(writer: asyncio.StreamWriter, frame: bytes) -> None:
    """Best effort: the peer may already be gone."""
    try:
        writer.write(frame)
        async with asyncio.timeout(1.0):
            await writer.drain()
    except (ConnectionError, TimeoutError):
        pass
