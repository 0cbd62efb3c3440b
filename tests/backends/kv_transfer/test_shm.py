"""Same-host pulls through shared memory: real files under a tmpfs, real loopback control connections."""
from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch

from backends.kv_transfer import (
    ChecksumKind,
    KVErrorCode,
    KVTransferConfig,
    KVTransferError,
    ReleaseMode,
    TcpTransport,
)
from backends.kv_transfer.base import KVLayerReader, SharedRegion
from backends.kv_transfer.protocol import (
    HEADER_SIZE,
    FrameType,
    PullRequest,
    decode_header,
    decode_json_meta,
    encode_json_frame,
)
from backends.kv_transfer.shm import SharedKVFile, joint_runs, stacked_bytes
from backends.kv_transfer.torch_cache import TorchPagedKV
from backends.worker.kv_cache import KVCache, KVCacheSpec
from tests.support.wait import await_until

from .conftest import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    assert_blocks_equal,
    assert_untouched,
    make_kv,
    remote,
    snapshot,
)

SRC_IDS = [17, 3, 40, 41, 42, 9]
DST_IDS = [5, 30, 2, 11, 12, 60]
pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfd")


def shared_source(num_blocks: int = 64, dtype: torch.dtype = torch.float32, seed: int = 1
                  ) -> tuple[TorchPagedKV, SharedKVFile]:
    """A prefill-side cache in shared memory, filled with random bytes."""
    shared = SharedKVFile(NUM_LAYERS, num_blocks, (BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype)
    random = make_kv(num_blocks, dtype, seed)
    for i, (k, v) in enumerate(random.layers):
        shared.tensor[i, 0].copy_(k)
        shared.tensor[i, 1].copy_(v)
    layers = [(shared.tensor[i, 0], shared.tensor[i, 1]) for i in range(NUM_LAYERS)]
    return TorchPagedKV(layers, region=shared.region), shared


def stacked_sink(num_blocks: int = 64, seed: int = 2) -> TorchPagedKV:
    """A decode-side cache laid out like the worker's KVCache (one buffer), random bytes."""
    cache = KVCache(KVCacheSpec(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32), "cpu")
    random = make_kv(num_blocks, torch.float32, seed)
    for k, v, (rk, rv) in zip(cache.k, cache.v, random.layers, strict=True):
        k.copy_(rk)
        v.copy_(rv)
    return TorchPagedKV(list(zip(cache.k, cache.v, strict=True)))


@contextlib.asynccontextmanager
async def served(src: TorchPagedKV, *files: SharedKVFile) -> AsyncIterator[tuple[int, TcpTransport]]:
    """(port of a server for `src`, a client); both closed afterwards, and `files` too."""
    server = TcpTransport()
    _, port = await server.serve(src, "127.0.0.1", 0)
    client = TcpTransport()
    try:
        yield port, client
    finally:
        await client.close()
        await server.close()
        for file in files:
            file.close()


def test_shared_file_is_zeroed_private_and_nameless() -> None:
    shared = SharedKVFile(NUM_LAYERS, 8, (BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), torch.bfloat16)
    path = Path(shared.region.path)
    assert path.parent == Path(f"/proc/{os.getpid()}/fd")
    assert not shared.tensor.any()
    with path.open("rb") as f:   # what a decode worker opens: the same memory
        assert f.read(8) == b"SYKVSHM1"
        shared.tensor[2, 1, 5].fill_(1.5)
        f.seek(shared.region.offset + ((2 * 2 + 1) * 8 + 5) * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2)
        assert torch.frombuffer(bytearray(f.read(4)), dtype=torch.bfloat16).tolist() == [1.5, 1.5]
    shared.close()
    assert not path.exists()
    shared.tensor.fill_(1)   # the mapping outlives the descriptor


def test_kv_cache_layers_are_one_stacked_buffer() -> None:
    cache = KVCache(KVCacheSpec(NUM_LAYERS, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float16), "cpu", shared=True)
    assert cache.shared_region is not None
    stacked = stacked_bytes(list(zip(cache.k, cache.v, strict=True)))
    assert stacked is not None and tuple(stacked.shape) == (NUM_LAYERS, 2, 8, BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2)
    cache.v[1][3].fill_(1.0)
    assert (stacked[1, 1, 3].view(torch.float16) == 1.0).all() and not stacked[1, 0].any()
    assert stacked_bytes([(cache.v[0], cache.k[0])]) is None   # not in [layer, K/V] order


def test_joint_runs() -> None:
    assert joint_runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9]) == [(4, 0, 2), (6, 7, 1), (9, 8, 2)]
    assert joint_runs([], []) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked-sink", "per-layer-sink"])
@pytest.mark.parametrize("src_ids, dst_ids", [
    (SRC_IDS, DST_IDS),                                   # a few runs: one copy per run
    (list(range(10, 16)), list(range(40, 46))),           # one run
    (list(range(63, 23, -1)), list(range(0, 40))),        # 40 runs of one block
], ids=["scattered", "contiguous", "many-runs"])
async def test_same_host_pull_copies_through_shared_memory(dtype: torch.dtype, stacked: bool, src_ids: list[int],
                                                           dst_ids: list[int]) -> None:
    src, shared = shared_source(dtype=dtype)
    dst = stacked_sink() if stacked and dtype == torch.float32 else make_kv(64, dtype, seed=2)
    before = snapshot(dst)
    async with served(src, shared) as (port, client):
        src.holds.hold("t", src_ids)
        result = await client.pull(remote(port, "t", len(src_ids)), dst, dst_ids)
        assert result.shared_memory and result.released
        assert result.num_bytes == src.layout().num_layers * src.layout().layer_nbytes(len(dst_ids))
        assert_blocks_equal(src, src_ids, dst, dst_ids)
        assert_untouched(dst, before, dst_ids)
        assert src.holds.lookup("t") is None


async def test_partial_pull_and_release_modes() -> None:
    src, shared = shared_source()
    dst = stacked_sink()
    server = TcpTransport()
    _, port = await server.serve(src, "127.0.0.1", 0)
    try:
        src.holds.hold("keep", SRC_IDS)
        never = TcpTransport(KVTransferConfig(release=ReleaseMode.NEVER))
        result = await never.pull(remote(port, "keep", len(SRC_IDS)), dst, DST_IDS[2:], start_block=2)
        assert result.shared_memory and not result.released and src.holds.lookup("keep") is not None
        assert_blocks_equal(src, SRC_IDS[2:], dst, DST_IDS[2:])
        assert await never.release(remote(port, "keep"))
        await never.close()
    finally:
        await server.close()
        shared.close()


async def test_client_that_cannot_map_the_region_gets_the_tcp_stream() -> None:
    """A region this process cannot open (as from another host or container) falls back to LAYER
    frames, and the client stops asking that server for shared memory."""
    src, shared = shared_source()
    src.region = SharedRegion("/proc/999999999/fd/3", shared.region.nonce, shared.region.offset, 64)
    dst = make_kv(64, seed=2)
    async with served(src, shared) as (port, client):
        for transfer_id in ("a", "b"):
            src.holds.hold(transfer_id, SRC_IDS)
            result = await client.pull(remote(port, transfer_id, len(SRC_IDS)), dst, DST_IDS)
            assert not result.shared_memory and result.released
            assert_blocks_equal(src, SRC_IDS, dst, DST_IDS)
        assert not client._mappings.wanted("127.0.0.1", port)


@pytest.mark.parametrize("path", ["/etc/passwd", "/proc/self/fd/0/../../environ", "relative/path"])
async def test_paths_other_than_a_process_descriptor_are_never_opened(path: str, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    src, shared = shared_source()
    src.region = SharedRegion(path, shared.region.nonce, shared.region.offset, 64)
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    dst = make_kv(64, seed=2)
    async with served(src, shared) as (port, client):
        src.holds.hold("t", SRC_IDS)
        result = await client.pull(remote(port, "t", len(SRC_IDS)), dst, DST_IDS)
        assert not result.shared_memory and path not in opened
        assert_blocks_equal(src, SRC_IDS, dst, DST_IDS)


async def test_a_region_of_another_cache_is_not_copied_from() -> None:
    """A path that exists but holds another cache (nonce differs) is never read: TCP instead."""
    src, shared = shared_source()
    other, other_file = shared_source(seed=5)
    src.region = SharedRegion(other.region.path, shared.region.nonce, shared.region.offset, 64)
    dst = make_kv(64, seed=2)
    async with served(src, shared, other_file) as (port, client):
        src.holds.hold("t", SRC_IDS)
        result = await client.pull(remote(port, "t", len(SRC_IDS)), dst, DST_IDS)
        assert not result.shared_memory
        assert_blocks_equal(src, SRC_IDS, dst, DST_IDS)


class CountingSource:
    """A source that counts open readers (the blocks they pin)."""

    def __init__(self, kv: TorchPagedKV) -> None:
        self.kv = kv
        self.open_readers = 0

    def layout(self):
        return self.kv.layout()

    def lookup(self, transfer_id: str) -> Sequence[int] | None:
        return self.kv.lookup(transfer_id)

    def release(self, transfer_id: str) -> bool:
        return self.kv.release(transfer_id)

    def shared_region(self) -> SharedRegion | None:
        return self.kv.shared_region()

    def reader(self, block_ids: Sequence[int], max_pieces: int) -> KVLayerReader:
        reader = self.kv.reader(block_ids, max_pieces)
        self.open_readers += 1
        source = self

        class Counted:
            def read_layer(self, layer: int):
                return reader.read_layer(layer)

            def close(self) -> None:
                reader.close()
                source.open_readers -= 1

        return Counted()


async def server_waits_for_the_client(server: TcpTransport) -> None:
    """Until the server's one connection task is suspended reading the client's answer to BEGIN (it has
    done all it does in between): a server that unpinned before that answer would have done so by now."""
    def reading_the_answer() -> bool:
        (task,) = server._server._connections   # type: ignore[union-attr]
        names, coro = [], task.get_coro()
        while coro is not None and hasattr(coro, "cr_code"):   # the chain of awaits, outermost first
            names.append(coro.cr_code.co_name)
            coro = coro.cr_await
        return "_offer_shared" in names and "readexactly" in names[names.index("_offer_shared"):]
    await await_until(reading_the_answer, "the server to wait for the client's answer to BEGIN")


async def read_frame(reader: asyncio.StreamReader) -> tuple[FrameType, dict]:
    header = decode_header(await reader.readexactly(HEADER_SIZE))
    return header.frame_type, decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))


@pytest.mark.parametrize("ending", ["copied", "disconnect", "garbage"])
async def test_blocks_stay_pinned_until_the_client_is_done(ending: str) -> None:
    kv, shared = shared_source()
    source = CountingSource(kv)
    server = TcpTransport(KVTransferConfig(idle_timeout_s=2.0))
    _, port = await server.serve(source, "127.0.0.1", 0)   # type: ignore[arg-type]
    try:
        kv.holds.hold("t", SRC_IDS)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = PullRequest("t", kv.layout(), ChecksumKind.NONE, ReleaseMode.AFTER_PULL, 0, len(SRC_IDS), True)
        writer.write(encode_json_frame(FrameType.PULL, request.to_wire()))
        ftype, begin = await read_frame(reader)
        assert ftype is FrameType.BEGIN and begin["block_ids"] == SRC_IDS
        assert SharedRegion.from_wire(begin["shared_memory"]) == shared.region
        assert source.open_readers == 1          # pinned while the client copies ...
        await server_waits_for_the_client(server)
        assert source.open_readers == 1          # ... and still, with the server waiting for its answer
        if ending == "copied":
            writer.write(encode_json_frame(FrameType.COPIED, {"transfer_id": "t", "release": True}))
            assert await read_frame(reader) == (FrameType.DONE, {"transfer_id": "t", "released": True})
        elif ending == "garbage":
            writer.write(encode_json_frame(FrameType.RELEASED, {"transfer_id": "t"}))
            ftype, error = await read_frame(reader)
            assert ftype is FrameType.ERROR and error["code"] == KVErrorCode.PROTOCOL.value
        writer.close()
        await await_until(lambda: source.open_readers == 0, "the server to unpin the blocks")
        assert (kv.holds.lookup("t") is None) == (ending == "copied")   # otherwise the hold is kept
    finally:
        await server.close()
        shared.close()


async def test_a_failing_copy_is_a_clean_error_and_keeps_the_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    src, shared = shared_source()
    dst = make_kv(64, seed=2)

    def broken(*_: object) -> int:
        raise MemoryError("simulated")

    monkeypatch.setattr("backends.kv_transfer.shm.copy_blocks", broken)
    async with served(src, shared) as (port, client):
        src.holds.hold("t", SRC_IDS)
        with pytest.raises(KVTransferError) as info:
            await client.pull(remote(port, "t", len(SRC_IDS)), dst, DST_IDS)
        assert info.value.code is KVErrorCode.INTERNAL and "shared-memory copy failed" in str(info.value)
        assert src.holds.lookup("t") is not None
        monkeypatch.undo()   # the server serves on, and the next pull works
        result = await client.pull(remote(port, "t", len(SRC_IDS)), dst, DST_IDS)
        assert result.shared_memory
        assert_blocks_equal(src, SRC_IDS, dst, DST_IDS)
