"""Same-GPU pulls through CUDA IPC. The wire records and the offer rules run everywhere; the copy itself needs two
processes on one GPU (`gpu`)."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from backends.kv_transfer import KVTransferConfig, TcpTransport
from backends.kv_transfer.base import CudaIpcRegion, SharedRegion, region_from_wire
from backends.kv_transfer.cuda_ipc import CudaIpcMappings, CudaIpcPull
from backends.kv_transfer.protocol import PullRequest
from backends.kv_transfer.shm import SharedMappings, SharedPull, stacked_bytes
from backends.kv_transfer.tcp_client import pull_blocks
from backends.kv_transfer.torch_cache import DictBlockHolds, TorchPagedKV
from backends.worker.kv_cache import KVCache, KVCacheSpec

from .conftest import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, assert_blocks_equal, make_kv, remote

REGION = CudaIpcRegion(device_uuid="GPU-1234", pid=1, handle="00ff" * 16, storage_nbytes=4096, storage_offset=0,
                       tensor_offset=0, ref_counter_handle="2f746d70", ref_counter_offset=3, event_handle="",
                       event_sync_required=False, num_blocks=64)


def test_region_wire_round_trip_and_rejects() -> None:
    assert region_from_wire(REGION.to_wire()) == REGION
    memfd = SharedRegion("/proc/1/fd/3", "0" * 32, 4096, 8)
    assert region_from_wire(memfd.to_wire()) == memfd   # no "kind": shared memory, as before
    for field, bad in (("handle", "xyz"), ("storage_nbytes", -1), ("num_blocks", True), ("pid", "1"),
                       ("event_sync_required", 0), ("device_uuid", None)):
        with pytest.raises(ValueError, match=field):
            region_from_wire({**REGION.to_wire(), field: bad})
    wire = REGION.to_wire()
    del wire["ref_counter_offset"]
    with pytest.raises(ValueError, match="ref_counter_offset"):
        region_from_wire(wire)


def test_pull_request_carries_the_cuda_ipc_flag() -> None:
    config = KVTransferConfig()
    request = PullRequest("t", make_kv(4).layout(), config.checksum, config.release, 0, 4, cuda_ipc=True)
    assert PullRequest.from_wire(request.to_wire()) == request
    old = request.to_wire()
    del old["cuda_ipc"]   # a client from before: no CUDA IPC
    assert PullRequest.from_wire(old).cuda_ipc is False
    with pytest.raises(ValueError, match="cuda_ipc"):
        PullRequest.from_wire({**request.to_wire(), "cuda_ipc": "yes"})


def test_each_copier_takes_only_its_own_kind_of_region() -> None:
    cpu = TorchPagedKV(list(zip(*_stacked_cpu(8), strict=True)))
    memfd = SharedRegion("/proc/1/fd/3", "0" * 32, 4096, 8)
    assert not CudaIpcPull(CudaIpcMappings(), cpu.layers, [0], cpu.layout(), "h", 1).prepare(memfd)
    assert not SharedPull(SharedMappings(), cpu.layers, [0], cpu.layout(), "h", 1).prepare(REGION)


def _stacked_cpu(num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cache = KVCache(KVCacheSpec(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32), "cpu")
    return cache.k, cache.v


class _CudaRegionSource(TorchPagedKV):
    """A CPU cache that announces a CUDA IPC region, to check who is offered one."""

    def shared_region(self) -> SharedRegion | CudaIpcRegion | None:
        return REGION


class _InProcessCopier:
    """A "cuda_ipc" copier that reads the server's cache in this process: the protocol's direct-copy path,
    without a GPU."""

    kind = "cuda_ipc"

    def __init__(self, src: TorchPagedKV, dst: TorchPagedKV, dst_ids: Sequence[int]) -> None:
        self.src, self.dst, self.dst_ids = src, dst, list(dst_ids)
        self.offered: SharedRegion | CudaIpcRegion | None = None

    def prepare(self, region: SharedRegion | CudaIpcRegion) -> bool:
        self.offered = region
        return isinstance(region, CudaIpcRegion)

    def copy(self, src_block_ids: list[int]) -> int:
        for (sk, sv), (dk, dv) in zip(self.src.layers, self.dst.layers, strict=True):
            dk[self.dst_ids] = sk[src_block_ids]
            dv[self.dst_ids] = sv[src_block_ids]
        return NUM_LAYERS * self.src.layout().layer_nbytes(len(src_block_ids))


@pytest.mark.parametrize("server_allows", [True, False])
async def test_a_cuda_region_is_offered_only_where_both_sides_want_it(server_allows: bool) -> None:
    held = DictBlockHolds()
    src = _CudaRegionSource(make_kv(64, seed=1).layers, held)
    server = TcpTransport(KVTransferConfig(shared_memory=server_allows))
    _, port = await server.serve(src, "127.0.0.1", 0)
    try:
        held.hold("cpu", [4, 9])
        dst = make_kv(64, seed=2)
        result = await TcpTransport().pull(remote(port, "cpu", 2), dst, [1, 2])   # a CPU client: never offered
        assert not result.shared_memory and not result.cuda_ipc
        assert_blocks_equal(src, [4, 9], dst, [1, 2])

        held.hold("ipc", [10, 11, 3])
        copier = _InProcessCopier(src, dst, [20, 21, 22])
        result = await pull_blocks(remote(port, "ipc", 3), dst, [20, 21, 22], 0, KVTransferConfig(), copier)
        assert (copier.offered == REGION) is server_allows
        assert result.shared_memory is server_allows and result.cuda_ipc is server_allows and result.released
        assert_blocks_equal(src, [10, 11, 3], dst, [20, 21, 22])
        assert held.lookup("ipc") is None
    finally:
        await server.close()


# --- two processes: on one host (shared memory) and on one GPU (CUDA IPC) ----------------------------------

NUM_BLOCKS = 96
SCATTERED = ([5, 90, 17, 3, 60, 61, 62, 40, 8, 77, 12, 33], [70, 2, 41, 9, 10, 55, 30, 31, 80, 6, 15, 94])
CONTIGUOUS = (list(range(20, 52)), list(range(0, 32)))


def _cache(seed: int, device: str, shared: bool = False) -> KVCache:
    """A worker-shaped (one buffer) cache of random bytes, bf16."""
    spec = KVCacheSpec(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    cache = KVCache(spec, device, shared=shared)
    flat = cache.stacked.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return cache


def _serve_cache(device: str, holds: dict[str, list[int]], ports: Any, stop: Any) -> None:
    """The prefill side, in its own process: serve a cache of seed 1 with these holds until told to stop (on
    the CPU in shared memory, as a prefill worker's is)."""
    async def main() -> None:
        cache, held = _cache(1, device, shared=device == "cpu"), DictBlockHolds()
        for transfer_id, ids in holds.items():
            held.hold(transfer_id, ids)
        source = TorchPagedKV(list(zip(cache.k, cache.v, strict=True)), held, region=cache.shared_region)
        server = TcpTransport()
        _, port = await server.serve(source, "127.0.0.1", 0)
        ports.put(port)
        await asyncio.to_thread(stop.wait)
        await server.close()

    asyncio.run(main())


async def _pull_from_another_process(device: str) -> list[tuple[bool, bool]]:
    """(shared_memory, cuda_ipc) of three pulls from a server process, each checked byte for byte."""
    holds = {"scattered": SCATTERED[0], "contiguous": CONTIGUOUS[0], "again": SCATTERED[0]}
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_cache, args=(device, holds, ports, stop), daemon=True)
    proc.start()
    paths = []
    try:
        port = await asyncio.to_thread(ports.get, True, 120)
        expected = _cache(1, "cpu").stacked   # what the other process holds
        dst_cache = _cache(2, device)
        dst = TorchPagedKV(list(zip(dst_cache.k, dst_cache.v, strict=True)))
        client = TcpTransport()
        for transfer_id, (src_ids, dst_ids) in (("scattered", SCATTERED), ("contiguous", CONTIGUOUS),
                                                ("again", (SCATTERED[0], SCATTERED[1][::-1]))):
            result = await client.pull(remote(port, transfer_id, len(src_ids)), dst, dst_ids)
            assert result.released, transfer_id
            paths.append((result.shared_memory, result.cuda_ipc))
            got = dst_cache.stacked.cpu()
            # exact: a transfer copies bytes
            assert torch.equal(got[:, :, dst_ids].view(torch.uint8), expected[:, :, src_ids].view(torch.uint8))
        await client.close()
    finally:
        stop.set()
        await asyncio.to_thread(proc.join, 30)
    return paths


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfd")
async def test_pulls_between_processes_on_one_host_copy_from_shared_memory() -> None:
    assert await _pull_from_another_process("cpu") == [(True, False)] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_pulls_between_processes_on_one_gpu_go_device_to_device() -> None:
    assert await _pull_from_another_process("cuda") == [(True, True)] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_cache_in_this_same_process_is_pulled_over_tcp() -> None:
    src_cache, dst_cache = _cache(1, "cuda"), _cache(2, "cuda")
    held = DictBlockHolds()
    src = TorchPagedKV(list(zip(src_cache.k, src_cache.v, strict=True)), held)
    dst = TorchPagedKV(list(zip(dst_cache.k, dst_cache.v, strict=True)))
    assert isinstance(src.shared_region(), CudaIpcRegion) and stacked_bytes(src.layers) is not None
    server = TcpTransport()
    _, port = await server.serve(src, "127.0.0.1", 0)
    try:
        held.hold("same", SCATTERED[0])
        result = await TcpTransport().pull(remote(port, "same", len(SCATTERED[0])), dst, SCATTERED[1])
        assert not result.cuda_ipc and not result.shared_memory
        got, want = dst_cache.stacked[:, :, SCATTERED[1]].cpu(), src_cache.stacked[:, :, SCATTERED[0]].cpu()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))   # bytes: random bf16 holds NaNs
    finally:
        await server.close()
