"""TcpTransport over real loopback sockets between real torch paged caches."""
from __future__ import annotations

import asyncio
import time

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
from backends.kv_transfer.torch_cache import TorchPagedKV
from tests.support.wait import DEFAULT_TIMEOUT_S, await_until

from .conftest import FaultyProxy, ProxyMode, assert_blocks_equal, assert_untouched, make_kv, remote, snapshot

SRC_IDS = [17, 3, 40, 41, 42, 9]   # a hold scattered over the prefill cache
DST_IDS = [5, 30, 2, 11, 12, 60]   # where the decode worker allocated


async def pull_and_check(src: TorchPagedKV, port: int, dst: TorchPagedKV, config: KVTransferConfig,
                         transfer_id: str, src_ids: list[int], dst_ids: list[int]) -> None:
    before = snapshot(dst)
    src.holds.hold(transfer_id, src_ids)
    result = await TcpTransport(config).pull(remote(port, transfer_id, len(src_ids)), dst, dst_ids)
    assert_blocks_equal(src, src_ids, dst, dst_ids)
    assert_untouched(dst, before, dst_ids)
    assert result.num_blocks == len(dst_ids)
    assert result.num_bytes == src.layout().num_layers * src.layout().layer_nbytes(len(dst_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("checksum", list(ChecksumKind))
async def test_scattered_blocks_arrive_byte_for_byte(dtype: torch.dtype, checksum: ChecksumKind) -> None:
    src, dst = make_kv(64, dtype, seed=1), make_kv(64, dtype, seed=2)
    server = TcpTransport()
    _, port = await server.serve(src, "127.0.0.1", 0)
    try:
        await pull_and_check(src, port, dst, KVTransferConfig(checksum=checksum), "t", SRC_IDS, DST_IDS)
        assert src.holds.lookup("t") is None  # AFTER_PULL: the client released it
    finally:
        await server.close()


@pytest.mark.parametrize("src_ids, dst_ids", [
    (list(range(10, 16)), list(range(40, 46))),  # both in place: no staging on either side
    (list(range(10, 16)), DST_IDS),              # sent in place, received through staging
    (SRC_IDS, list(range(40, 46))),              # gathered, received in place
])
async def test_contiguous_runs(served, src_ids: list[int], dst_ids: list[int]) -> None:
    src, _, port = served
    await pull_and_check(src, port, make_kv(64, seed=2), KVTransferConfig(), "run", src_ids, dst_ids)


def test_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        src, dst = make_kv(64, torch.bfloat16, seed=1), make_kv(64, torch.bfloat16, seed=2)
        server = TcpTransport()
        _, port = await server.serve(src, "127.0.0.1", 0)
        try:
            for i in range(3):  # staging buffers are reused across pulls
                await pull_and_check(src, port, dst, KVTransferConfig(), f"u{i}", SRC_IDS, DST_IDS[::-1])
        finally:
            await server.close()

    uvloop.run(main())


async def test_release_modes(served) -> None:
    src, _, port = served
    dst = make_kv(64, seed=2)
    src.holds.hold("a", SRC_IDS)
    src.holds.hold("b", SRC_IDS)
    on_send = await TcpTransport(KVTransferConfig(release=ReleaseMode.ON_SEND)).pull(remote(port, "a"), dst, DST_IDS)
    assert on_send.released and src.holds.lookup("a") is None
    client = TcpTransport(KVTransferConfig(release=ReleaseMode.NEVER))
    kept = await client.pull(remote(port, "b"), dst, DST_IDS)
    assert not kept.released and src.holds.lookup("b") == tuple(SRC_IDS)
    assert await client.release(remote(port, "b")) is True
    assert await client.release(remote(port, "b")) is False  # unknown now: a clean answer
    assert src.holds.lookup("b") is None


async def test_partial_pull_skips_blocks_the_decode_side_has(served) -> None:
    src, _, port = served
    dst = make_kv(64, seed=2)
    src.holds.hold("p", SRC_IDS)
    await TcpTransport().pull(remote(port, "p", len(SRC_IDS)), dst, DST_IDS[:4], start_block=2)
    assert_blocks_equal(src, SRC_IDS[2:], dst, DST_IDS[:4])


async def test_concurrent_transfers(served) -> None:
    src, _, port = served
    dst = make_kv(64, seed=2)
    client = TcpTransport()
    holds = {f"c{i}": (list(range(i * 6, i * 6 + 6))[::-1], list(range(63 - i * 7, 57 - i * 7, -1))) for i in range(8)}
    for tid, (src_ids, _) in holds.items():
        src.holds.hold(tid, src_ids)
    results = await asyncio.gather(*(client.pull(remote(port, tid), dst, d) for tid, (_, d) in holds.items()))
    assert all(r.released for r in results)
    for src_ids, dst_ids in holds.values():
        assert_blocks_equal(src, src_ids, dst, dst_ids)


async def test_unknown_transfer_is_a_clean_error_and_the_server_serves_on(served) -> None:
    src, _, port = served
    with pytest.raises(KVTransferError) as info:
        await TcpTransport().pull(remote(port, "nope"), make_kv(64), DST_IDS)
    assert info.value.code is KVErrorCode.UNKNOWN_TRANSFER and "'nope'" in str(info.value)
    await pull_and_check(src, port, make_kv(64, seed=2), KVTransferConfig(), "after", SRC_IDS, DST_IDS)


@pytest.mark.parametrize("sink, needle", [
    (lambda: make_kv(64, torch.float16), "dtype: float32 here vs float16 at the peer"),
    (lambda: make_kv(64, num_kv_heads=4), "num_kv_heads: 2 here vs 4 at the peer"),
    (lambda: make_kv(64, block_size=8), "block_size: 4 here vs 8 at the peer"),
])
async def test_layout_mismatch_is_refused(served, sink, needle: str) -> None:
    src, _, port = served
    src.holds.hold("m", SRC_IDS)
    with pytest.raises(KVTransferError) as info:
        await TcpTransport().pull(remote(port, "m"), sink(), DST_IDS)
    assert info.value.code is KVErrorCode.LAYOUT_MISMATCH and needle in str(info.value)
    assert src.holds.lookup("m") == tuple(SRC_IDS)  # refused, not released


async def test_kv_of_other_weights_is_refused() -> None:
    """Caches of one shape filled by other weights (a new revision mid rolling-upgrade): the pull is refused,
    naming the weights, and the hold stays. A side that does not know its weights (a peer from before they
    were sent) is not compared on them, so it pulls as it did."""
    src = make_kv(64, seed=1, weights="a1" * 16)
    server = TcpTransport(KVTransferConfig(idle_timeout_s=2.0))
    _, port = await server.serve(src, "127.0.0.1", 0)
    try:
        src.holds.hold("w", SRC_IDS)
        other = make_kv(64, seed=2, weights="b2" * 16)
        before = snapshot(other)
        with pytest.raises(KVTransferError) as info:
            await TcpTransport().pull(remote(port, "w"), other, DST_IDS)
        assert info.value.code is KVErrorCode.LAYOUT_MISMATCH
        assert f"weights: {'a1' * 16} here vs {'b2' * 16} at the peer" in str(info.value)
        assert_untouched(other, before, [])
        assert src.holds.lookup("w") == tuple(SRC_IDS)  # refused, not released
        for weights in ("a1" * 16, ""):
            await pull_and_check(src, port, make_kv(64, seed=3, weights=weights), KVTransferConfig(),
                                 f"same-{weights}", SRC_IDS, DST_IDS)
    finally:
        await server.close()


async def test_block_count_mismatches(served) -> None:
    src, _, port = served
    src.holds.hold("n", SRC_IDS)
    with pytest.raises(KVTransferError) as info:  # caught locally from kv_transfer_params
        await TcpTransport().pull(remote(port, "n", 6), make_kv(64), DST_IDS[:5])
    assert info.value.code is KVErrorCode.BAD_REQUEST
    with pytest.raises(KVTransferError) as info:  # caught by the server
        await TcpTransport().pull(remote(port, "n"), make_kv(64), DST_IDS[:5])
    assert info.value.code is KVErrorCode.BAD_REQUEST and "hold has 6 blocks" in str(info.value)
    with pytest.raises(ValueError, match="outside the cache"):
        await TcpTransport().pull(remote(port, "n"), make_kv(64), [1, 2, 3, 4, 5, 64])
    assert src.holds.lookup("n") == tuple(SRC_IDS)


async def test_corrupted_byte_is_caught_by_the_checksum(served) -> None:
    src, _, port = served
    src.holds.hold("x", SRC_IDS)
    layer_bytes = src.layout().layer_nbytes(len(SRC_IDS))  # 6 blocks: 3 KiB per layer
    proxy = FaultyProxy(port, ProxyMode.CORRUPT, at=300 + layer_bytes + 100)  # inside layer 1's payload
    await proxy.start()
    try:
        with pytest.raises(KVTransferError) as info:
            await TcpTransport().pull(remote(proxy.port, "x"), make_kv(64, seed=2), DST_IDS)
        assert info.value.code is KVErrorCode.CHECKSUM_MISMATCH and "layer 1" in str(info.value)
        assert src.holds.lookup("x") == tuple(SRC_IDS)  # kept for a retry
        # Without a checksum the same corruption goes unnoticed: the check is what catches it.
        proxy.at = 300 + layer_bytes + 100
        dst = make_kv(64, seed=2)
        await TcpTransport(KVTransferConfig(checksum=ChecksumKind.NONE,
                                              release=ReleaseMode.NEVER)).pull(remote(proxy.port, "x"), dst, DST_IDS)
        with pytest.raises(AssertionError, match="layer 1"):
            assert_blocks_equal(src, SRC_IDS, dst, DST_IDS)
    finally:
        await proxy.close()


async def test_connection_cut_midway_fails_fast_and_the_server_serves_on(served) -> None:
    src, _, port = served
    src.holds.hold("cut", SRC_IDS)
    proxy = FaultyProxy(port, ProxyMode.CUT, at=5000)
    await proxy.start()
    try:
        with pytest.raises(KVTransferError) as info:
            await TcpTransport().pull(remote(proxy.port, "cut"), make_kv(64, seed=2), DST_IDS)
        # PEER_CLOSED, not TIMEOUT: the close itself ended the pull, not the 10 s idle timeout after it
        assert info.value.code is KVErrorCode.PEER_CLOSED and "layer 1 payload" in str(info.value)
    finally:
        await proxy.close()
    await pull_and_check(src, port, make_kv(64, seed=2), KVTransferConfig(), "cut", SRC_IDS, DST_IDS)


async def test_stalled_peer_hits_the_idle_timeout(served) -> None:
    src, _, port = served
    src.holds.hold("stall", SRC_IDS)
    proxy = FaultyProxy(port, ProxyMode.STALL, at=5000)
    await proxy.start()
    try:
        started = time.monotonic()
        with pytest.raises(KVTransferError) as info:
            await TcpTransport(KVTransferConfig(idle_timeout_s=0.3)).pull(
                remote(proxy.port, "stall"), make_kv(64, seed=2), DST_IDS)
        assert time.monotonic() - started >= 0.3   # it waited the idle timeout out (a lower bound the code keeps)
        # the idle check ("no bytes for"), not the 300 s total timeout ("took over")
        assert info.value.code is KVErrorCode.TIMEOUT and "no bytes for" in str(info.value)
    finally:
        await proxy.close()


async def test_total_timeout_and_connect_failure() -> None:
    accepted: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)  # never answers
    port = silent.sockets[0].getsockname()[1]
    try:
        with pytest.raises(KVTransferError) as info:
            await TcpTransport(KVTransferConfig(total_timeout_s=0.3)).pull(remote(port, "t"), make_kv(64), DST_IDS)
        assert info.value.code is KVErrorCode.TIMEOUT and "took over 0.3 s" in str(info.value)
    finally:
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()
    with pytest.raises(KVTransferError) as info:
        await TcpTransport().pull(remote(port, "t"), make_kv(64), DST_IDS)
    assert info.value.code is KVErrorCode.CONNECT_FAILED


async def test_garbage_gets_a_protocol_error_and_the_server_serves_on(served) -> None:
    src, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), DEFAULT_TIMEOUT_S)  # an ERROR frame, then close
    writer.close()
    assert reply[:4] == b"SYKV" and b"bad magic" in reply
    await pull_and_check(src, port, make_kv(64, seed=2), KVTransferConfig(), "g", SRC_IDS, DST_IDS)


async def test_server_drops_a_client_that_stops_reading() -> None:
    src = make_kv(2048, torch.float32, seed=1)  # 2048 blocks = 12 MiB per pull, more than socket buffers
    server = TcpTransport(KVTransferConfig(idle_timeout_s=0.3))
    _, port = await server.serve(src, "127.0.0.1", 0)
    src.holds.hold("big", list(range(2048)))
    try:
        from backends.kv_transfer.protocol import FrameType, PullRequest, encode_json_frame
        request = PullRequest("big", src.layout(), ChecksumKind.NONE, ReleaseMode.AFTER_PULL, 0, 2048)
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(encode_json_frame(FrameType.PULL, request.to_wire()))
        # Never read: the server's drain stalls, and 0.3 s without progress later it gives up.
        await await_until(lambda: not server._server._connections,  # type: ignore[union-attr]
                          "the server to drop the connection")
        writer.close()
        assert src.holds.lookup("big") is not None
        dst = make_kv(2048, torch.float32, seed=2)
        await TcpTransport().pull(remote(port, "big"), dst, list(range(2048)))
        assert_blocks_equal(src, range(2048), dst, range(2048))
    finally:
        await server.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_caches_through_pinned_staging() -> None:
    src_cpu, dst_cpu = make_kv(64, torch.bfloat16, seed=1), make_kv(64, torch.bfloat16, seed=2)
    src = TorchPagedKV([(k.cuda(), v.cuda()) for k, v in src_cpu.layers])
    dst = TorchPagedKV([(k.cuda(), v.cuda()) for k, v in dst_cpu.layers])
    server = TcpTransport()
    _, port = await server.serve(src, "127.0.0.1", 0)
    try:
        src.holds.hold("g", SRC_IDS)
        await TcpTransport().pull(remote(port, "g"), dst, DST_IDS)
        for (sk, sv), (dk, dv) in zip(src.layers, dst.layers, strict=True):
            # exact: the pull copies bytes
            assert torch.equal(sk[SRC_IDS].view(torch.uint8).cpu(), dk[DST_IDS].view(torch.uint8).cpu())
            assert torch.equal(sv[SRC_IDS].view(torch.uint8).cpu(), dv[DST_IDS].view(torch.uint8).cpu())
    finally:
        await server.close()


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_long_runs_go_out_and_land_in_place(loop_name: str) -> None:
    src, dst = make_kv(4200, torch.float32, seed=1), make_kv(4200, torch.float32, seed=2)  # 256 B blocks
    src_ids = [*range(100, 1124), *range(3000, 4100), 7]     # 3 runs: sent as pieces under uvloop
    dst_ids = [*range(2000, 3024), *range(0, 1101)]          # 2 runs of >= 256 KiB: received in place

    async def main() -> None:
        server = TcpTransport()
        _, port = await server.serve(src, "127.0.0.1", 0)
        try:
            await pull_and_check(src, port, dst, KVTransferConfig(), "long", src_ids, dst_ids)
        finally:
            await server.close()

    if loop_name == "uvloop":
        pytest.importorskip("uvloop").run(main())
    else:
        asyncio.run(main())
    assert not dst._free_staging


def test_staging_pool_keeps_buffers_of_different_sizes() -> None:
    """Pooled staging buffers are found and dropped by size and position: list.remove compared them with
    == elementwise and raised on two of different sizes (found on CUDA, where every pull stages)."""
    kv = make_kv(8, torch.float32, seed=1)
    small, big = kv._acquire_staging(100), kv._acquire_staging(1000)
    kv._return_staging(small)
    kv._return_staging(big)
    assert kv._acquire_staging(500) is big            # the smallest buffer that fits
    assert kv._acquire_staging(50) is small
    extra = [torch.empty(10 * (i + 1), dtype=torch.uint8) for i in range(6)]
    for buf in extra:
        kv._return_staging(buf)
    assert [b.numel() for b in kv._free_staging] == [30, 40, 50, 60]   # over the cap: the smallest go
