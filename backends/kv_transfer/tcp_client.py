"""The decode worker's side of a pull: an `asyncio.BufferedProtocol` whose `get_buffer` hands
the transport a memoryview into the sink's landing buffer, so layer bytes land without
intermediate `bytes` objects. Knows nothing of torch or the engine.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer import auth
from backends.kv_transfer.base import (
    ChecksumKind,
    CudaIpcRegion,
    KVBlockSink,
    KVErrorCode,
    KVLayerWriter,
    KVLayout,
    KVTransferConfig,
    KVTransferError,
    PullResult,
    ReleaseMode,
    SharedRegion,
    region_from_wire,
)
from backends.kv_transfer.protocol import (
    HEADER_SIZE,
    FrameHeader,
    FrameType,
    PullRequest,
    decode_error,
    decode_header,
    decode_json_meta,
    decode_layer_meta,
    encode_json_frame,
    layer_checksum,
)

log = logging.getLogger(__name__)


class _Stage(enum.Enum):
    AWAIT_CHALLENGE = "waiting for CHALLENGE (has the listener the pool's key?)"
    AWAIT_BEGIN = "waiting for BEGIN"
    COPYING = "copying from shared memory"
    AWAIT_DONE = "waiting for DONE"
    LAYERS = "receiving layers"
    AWAIT_RELEASED = "waiting for RELEASED"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class _Outcome:
    num_bytes: int   # payload bytes received
    released: bool   # the remote hold is gone
    shared: bool     # copied from the server's cache directly
    cuda_ipc: bool   # that copy was device to device (CUDA IPC)


class SharedCopier(Protocol):
    """The direct-copy path of one pull: shm.SharedPull (kind "memfd") or cuda_ipc.CudaIpcPull ("cuda_ipc")."""

    kind: str

    def prepare(self, region: SharedRegion | CudaIpcRegion) -> bool:
        """Map or open the region BEGIN names; False when it cannot be used here (then the pull streams)."""
        ...

    def copy(self, src_block_ids: list[int]) -> int:
        """Copy the region's blocks into the pull's local blocks (in a worker thread); bytes copied."""
        ...


class _PullProtocol(asyncio.BufferedProtocol):
    """A state machine over frames; all placement happens inside `buffer_updated`."""

    def __init__(self, request: PullRequest, writer: KVLayerWriter, config: KVTransferConfig,
                 shared: SharedCopier | None = None) -> None:
        self._request = request
        self._writer = writer
        self._config = config
        self._shared = shared
        self._copy_task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[_Outcome] = self._loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._stage = _Stage.AWAIT_BEGIN
        self._header_buf = bytearray(HEADER_SIZE)
        self._header: FrameHeader | None = None
        # The pieces the next bytes go to, in order, and what to do once all are full.
        self._pieces: list[memoryview] = []
        self._piece = 0
        self._pos = 0
        self._on_filled: Callable[[], None] = self._on_header
        self._reading = "header of the first frame"
        self._next_layer = 0
        self._layer_checksum = 0
        self._num_bytes = 0
        self._last_rx = self._loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._arm_idle_timer()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._config.key is None:
            self._transport.write(encode_json_frame(FrameType.PULL, self._request.to_wire()))
        else:
            self._stage = _Stage.AWAIT_CHALLENGE   # the keyed listener speaks first
        self._expect_header()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._pieces[self._piece][self._pos:]

    def buffer_updated(self, nbytes: int) -> None:
        self._last_rx = self._loop.time()
        self._pos += nbytes
        if self._pos < len(self._pieces[self._piece]):
            return
        self._piece += 1
        self._pos = 0
        if self._piece < len(self._pieces):
            return
        try:
            self._on_filled()
        except KVTransferError as exc:
            self._fail(exc)
        except Exception as exc:  # the sink failed inside a transport callback: fail this pull
            log.exception("KV pull %s: placing bytes failed", self._request.transfer_id)
            self._fail(KVTransferError(KVErrorCode.INTERNAL, f"local sink failed: {exc!r}"))

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if not self.done.done():
            got = self._pos + sum(len(p) for p in self._pieces[:self._piece])
            want = sum(len(p) for p in self._pieces)
            self.done.set_exception(KVTransferError(
                KVErrorCode.PEER_CLOSED,
                f"connection closed while {self._stage.value} (reading {self._reading}: "
                f"{got} of {want} bytes){f': {exc!r}' if exc else ''}"))

    # -- frame state machine --------------------------------------------------------------------

    def _expect(self, pieces: list[memoryview], on_filled: Callable[[], None], reading: str) -> None:
        # An empty buffer from get_buffer would read as EOF, so empty pieces are dropped.
        self._pieces, self._piece, self._pos = [p for p in pieces if len(p)], 0, 0
        self._on_filled, self._reading = on_filled, reading
        if not self._pieces:
            on_filled()

    def _expect_header(self) -> None:
        self._expect([memoryview(self._header_buf)], self._on_header, "a frame header")

    def _on_header(self) -> None:
        header = decode_header(self._header_buf)
        self._header = header
        if header.frame_type is FrameType.LAYER:
            self._expect([memoryview(bytearray(header.meta_len))], self._on_layer_meta, "LAYER metadata")
        else:
            self._expect([memoryview(bytearray(header.meta_len))], self._on_json_meta,
                         f"{header.frame_type.name} metadata")

    def _on_json_meta(self) -> None:
        assert self._header is not None
        ftype = self._header.frame_type
        meta = decode_json_meta(ftype, self._pieces[0])
        if ftype is FrameType.ERROR:
            raise decode_error(meta)
        if ftype is FrameType.CHALLENGE and (self._stage is _Stage.AWAIT_CHALLENGE or (
                self._config.key is None and self._stage is _Stage.AWAIT_BEGIN)):
            self._on_challenge(meta)
        elif ftype is FrameType.BEGIN and self._stage is _Stage.AWAIT_BEGIN:
            self._on_begin(meta)
        elif ftype is FrameType.DONE and self._stage is _Stage.LAYERS \
                and self._next_layer == self._request.layout.num_layers:
            self._on_done(meta)
        elif (ftype is FrameType.DONE and self._stage is _Stage.AWAIT_DONE) \
                or (ftype is FrameType.RELEASED and self._stage is _Stage.AWAIT_RELEASED):
            self._finish(released=meta.get("released") is True)
        else:
            raise KVTransferError(KVErrorCode.PROTOCOL, f"unexpected {ftype.name} frame while {self._stage.value}")

    def _on_challenge(self, meta: dict[str, object]) -> None:
        """Prove the key (UNAUTHORIZED without one), then ask for the blocks at once: no extra round trip."""
        assert self._transport is not None
        self._transport.write(auth.auth_frame(self._config.key, meta)
                              + encode_json_frame(FrameType.PULL, self._request.to_wire()))
        self._stage = _Stage.AWAIT_BEGIN
        self._expect_header()

    def _on_begin(self, meta: dict[str, object]) -> None:
        try:
            layout = KVLayout.from_wire(meta.get("layout"))  # type: ignore[arg-type]
        except ValueError as exc:
            raise KVTransferError(KVErrorCode.PROTOCOL, f"BEGIN: {exc}") from None
        diff = self._request.layout.mismatch(layout)
        if diff is not None:
            raise KVTransferError(KVErrorCode.LAYOUT_MISMATCH, f"KV cache layouts differ: {diff}")
        if meta.get("num_blocks") != self._request.num_blocks:
            raise KVTransferError(KVErrorCode.PROTOCOL, f"BEGIN announces {meta.get('num_blocks')} blocks, "
                                                        f"asked for {self._request.num_blocks}")
        if "shared_memory" in meta:
            self._on_shared_begin(meta)
            return
        self._stage = _Stage.LAYERS
        self._expect_header()

    def _on_shared_begin(self, meta: dict[str, object]) -> None:
        """Copy from the region BEGIN names (off the event loop), or ask for LAYER frames instead."""
        assert self._transport is not None
        try:
            region = region_from_wire(meta["shared_memory"])
            src = meta.get("block_ids")
            if not (isinstance(src, list) and len(src) == self._request.num_blocks
                    and all(type(b) is int and 0 <= b < region.num_blocks for b in src)):
                raise ValueError("block_ids do not match the request")
        except ValueError as exc:
            raise KVTransferError(KVErrorCode.PROTOCOL, f"shared-memory BEGIN: {exc}") from None
        if self._shared is None or not self._shared.prepare(region):
            self._transport.write(encode_json_frame(FrameType.STREAM, {"transfer_id": self._request.transfer_id}))
            self._stage = _Stage.AWAIT_BEGIN   # the server starts over with a plain BEGIN
            self._expect_header()
            return
        self._stage = _Stage.COPYING
        self._copy_task = self._loop.create_task(self._copy_shared(src))
        self._expect_header()   # nothing should come now but an ERROR or the end of the connection

    async def _copy_shared(self, src_block_ids: list[int]) -> None:
        assert self._shared is not None and self._transport is not None
        try:
            self._num_bytes = await asyncio.to_thread(self._shared.copy, src_block_ids)
        except Exception as exc:  # the sink or the mapping failed: fail this pull, keep the hold
            log.exception("KV pull %s: copying from shared memory failed", self._request.transfer_id)
            self._fail(KVTransferError(KVErrorCode.INTERNAL, f"shared-memory copy failed: {exc!r}"))
            return
        if self.done.done() or self._transport.is_closing():
            return   # the connection broke while copying: the blocks may have been recycled
        self._last_rx = self._loop.time()
        release = self._request.release is not ReleaseMode.NEVER
        self._transport.write(encode_json_frame(FrameType.COPIED, {"transfer_id": self._request.transfer_id,
                                                                   "release": release}))
        self._stage = _Stage.AWAIT_DONE

    def _on_layer_meta(self) -> None:
        assert self._header is not None
        layer, checksum = decode_layer_meta(self._pieces[0])
        if self._stage is not _Stage.LAYERS or layer != self._next_layer:
            raise KVTransferError(KVErrorCode.PROTOCOL, f"LAYER {layer} while {self._stage.value}, "
                                                        f"expected layer {self._next_layer}")
        want = self._request.layout.layer_nbytes(self._request.num_blocks)
        if self._header.payload_len != want:
            raise KVTransferError(KVErrorCode.PROTOCOL,
                                  f"LAYER {layer} payload is {self._header.payload_len} bytes, expected {want}")
        pieces = list(self._writer.layer_buffer(layer))
        if sum(len(p) for p in pieces) != want:
            raise KVTransferError(KVErrorCode.INTERNAL, f"local sink gave {sum(len(p) for p in pieces)} bytes "
                                                        f"for layer {layer}, expected {want}")
        self._layer_checksum = checksum
        self._expect(pieces, self._on_layer_payload, f"layer {layer} payload")

    def _on_layer_payload(self) -> None:
        layer = self._next_layer
        if self._request.checksum is not ChecksumKind.NONE:
            got = layer_checksum(self._request.checksum, self._pieces)
            if got != self._layer_checksum:
                raise KVTransferError(KVErrorCode.CHECKSUM_MISMATCH,
                                      f"layer {layer}: {self._request.checksum.value} {got:#x}, "
                                      f"sender said {self._layer_checksum:#x}")
        self._writer.commit_layer(layer)
        self._num_bytes += sum(len(p) for p in self._pieces)
        self._next_layer += 1
        self._expect_header()

    def _on_done(self, meta: dict[str, object]) -> None:
        if self._request.release is ReleaseMode.AFTER_PULL:
            assert self._transport is not None
            self._transport.write(encode_json_frame(FrameType.RELEASE, {"transfer_id": self._request.transfer_id}))
            self._stage = _Stage.AWAIT_RELEASED
            self._expect_header()
        else:
            self._finish(released=meta.get("released") is True)

    async def settle(self) -> None:
        """Wait for a shared-memory copy still writing into the sink (it cannot be interrupted), so
        that no byte lands in the local blocks after the pull has returned or failed."""
        if self._copy_task is not None and not self._copy_task.done():
            await asyncio.wait([self._copy_task])

    def _finish(self, released: bool) -> None:
        self._stage = _Stage.FINISHED
        if not self.done.done():
            copied = self._copy_task is not None
            cuda_ipc = copied and self._shared is not None and self._shared.kind == "cuda_ipc"
            self.done.set_result(_Outcome(self._num_bytes, released, copied, cuda_ipc))
        self._expect_header()

    def _fail(self, exc: KVTransferError) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self._transport is not None:
            self._transport.abort()

    # -- idle timeout: a cheap timestamp per read, checked a few times per period -----------------

    def _arm_idle_timer(self) -> None:
        self._idle_timer = self._loop.call_later(self._config.idle_timeout_s / 4, self._check_idle)

    def _check_idle(self) -> None:
        if self.done.done():
            return
        idle_s = self._loop.time() - self._last_rx
        if idle_s >= self._config.idle_timeout_s:
            self._fail(KVTransferError(KVErrorCode.TIMEOUT, f"no bytes for {idle_s:.1f} s while "
                                                            f"{self._stage.value} (reading {self._reading})"))
        else:
            self._arm_idle_timer()


async def pull_blocks(remote: RemoteBlocks, sink: KVBlockSink, block_ids: Sequence[int],
                      start_block: int, config: KVTransferConfig, shared: SharedCopier | None = None) -> PullResult:
    """Pull the remote hold's blocks [start_block:] into local `block_ids`, layer by layer over TCP,
    or through `shared` when given and the server's cache is in shared memory this process can map."""
    if remote.num_blocks is not None and remote.num_blocks - start_block != len(block_ids):
        raise KVTransferError(KVErrorCode.BAD_REQUEST, f"{len(block_ids)} local blocks for "
                                                       f"{remote.num_blocks - start_block} remote blocks")
    request = PullRequest(transfer_id=remote.transfer_id, layout=sink.layout(), checksum=config.checksum,
                          release=config.release, start_block=start_block, num_blocks=len(block_ids),
                          shared_memory=shared is not None and shared.kind == "memfd",
                          cuda_ipc=shared is not None and shared.kind == "cuda_ipc")
    started = time.perf_counter()
    writer = sink.writer(block_ids)
    try:
        async with asyncio.timeout(config.total_timeout_s):
            transport, protocol = await _connect(
                remote, lambda: _PullProtocol(request, writer, config, shared), config.connect_timeout_s)
            try:
                outcome = await protocol.done
            finally:
                transport.close()
                await protocol.settle()
    except TimeoutError:
        raise KVTransferError(KVErrorCode.TIMEOUT, f"pull of {remote.transfer_id!r} from {remote.host}:"
                                                   f"{remote.port} took over {config.total_timeout_s} s") from None
    finally:
        writer.close()
    return PullResult(transfer_id=remote.transfer_id, num_blocks=len(block_ids), num_bytes=outcome.num_bytes,
                      elapsed_s=time.perf_counter() - started, released=outcome.released,
                      shared_memory=outcome.shared, cuda_ipc=outcome.cuda_ipc)


async def _connect(remote: RemoteBlocks, factory: Callable[[], _PullProtocol],
                   timeout_s: float) -> tuple[asyncio.BaseTransport, _PullProtocol]:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            return await loop.create_connection(factory, remote.host, remote.port)
    except TimeoutError:
        raise KVTransferError(KVErrorCode.TIMEOUT,
                              f"connect to {remote.host}:{remote.port} took over {timeout_s} s") from None
    except OSError as exc:
        raise KVTransferError(KVErrorCode.CONNECT_FAILED, f"{remote.host}:{remote.port}: {exc}") from None
