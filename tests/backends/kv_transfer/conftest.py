"""Helpers for the KV transfer tests: paged caches of random bytes and a misbehaving TCP proxy."""
from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer import KVTransferConfig, TcpTransport
from backends.kv_transfer.torch_cache import TorchPagedKV

# Small caches: 3 layers of [num_blocks, block_size 4, 2 KV heads, head_dim 8].
NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 4, 2, 8


def make_kv(num_blocks: int, dtype: torch.dtype = torch.float32, seed: int = 0, *,
            num_kv_heads: int = NUM_KV_HEADS, block_size: int = BLOCK_SIZE, weights: str = "") -> TorchPagedKV:
    """A cache filled with random bytes (every bit pattern, NaNs included), each layer's K and V apart, of the
    weights `weights` names ("": not known)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    nbytes = torch.Size(shape).numel() * dtype.itemsize

    def tensor() -> torch.Tensor:
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)

    return TorchPagedKV([(tensor(), tensor()) for _ in range(NUM_LAYERS)], weights=weights)


def snapshot(kv: TorchPagedKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in kv.layers]


def assert_blocks_equal(src: TorchPagedKV, src_ids: Sequence[int], dst: TorchPagedKV, dst_ids: Sequence[int]) -> None:
    """Byte-for-byte (exact: a transfer copies bytes): every layer's K and V of src blocks == dst blocks, in order."""
    for layer, ((sk, sv), (dk, dv)) in enumerate(zip(src.layers, dst.layers, strict=True)):
        for name, s, d in (("K", sk, dk), ("V", sv, dv)):
            want = s[list(src_ids)].view(torch.uint8)
            got = d[list(dst_ids)].view(torch.uint8)
            assert torch.equal(want, got), f"layer {layer} {name} differs"


def assert_untouched(dst: TorchPagedKV, before: list[tuple[torch.Tensor, torch.Tensor]],
                     written: Sequence[int]) -> None:
    """Byte-for-byte (exact: nothing wrote them): the blocks outside `written` are as they were."""
    written_set = set(written)
    others = [b for b in range(dst.num_blocks) if b not in written_set]
    for (k, v), (k0, v0) in zip(dst.layers, before, strict=True):
        assert torch.equal(k[others].view(torch.uint8), k0[others].view(torch.uint8))
        assert torch.equal(v[others].view(torch.uint8), v0[others].view(torch.uint8))


class ProxyMode(enum.Enum):
    CORRUPT = "flip one byte of the server's stream at `at`"
    CUT = "close both sides after `at` bytes from the server"
    STALL = "stop forwarding (connection kept open) after `at` bytes from the server"


class FaultyProxy:
    """A real TCP proxy between client and server that breaks the server->client stream."""

    def __init__(self, upstream_port: int, mode: ProxyMode, at: int) -> None:
        self.upstream_port, self.mode, self.at = upstream_port, mode, at
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _on_client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._relay(c_reader, c_writer))
        self._tasks.add(task)

    async def _relay(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        u_reader, u_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [c_writer, u_writer]
        up = asyncio.get_running_loop().create_task(_pipe(c_reader, u_writer))
        self._tasks.add(up)
        sent = 0
        while data := await u_reader.read(65536):
            if sent + len(data) > self.at:
                cut = self.at - sent
                if self.mode is ProxyMode.CORRUPT:
                    data = data[:cut] + bytes([data[cut] ^ 0x5A]) + data[cut + 1:]
                    self.at = 1 << 62  # once
                elif self.mode is ProxyMode.CUT:
                    c_writer.write(data[:cut])
                    await c_writer.drain()
                    c_writer.transport.abort()
                    u_writer.transport.abort()
                    return
                else:
                    c_writer.write(data[:cut])
                    await asyncio.sleep(3600)
            c_writer.write(data)
            await c_writer.drain()
            sent += len(data)
        c_writer.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


@pytest.fixture
async def served() -> AsyncIterator[tuple[TorchPagedKV, TcpTransport, int]]:
    """A prefill-side cache (64 blocks, fp32) served on an ephemeral loopback port."""
    source = make_kv(64, torch.float32, seed=1)
    transport = TcpTransport(KVTransferConfig(idle_timeout_s=2.0))
    _, port = await transport.serve(source, "127.0.0.1", 0)
    yield source, transport, port
    await transport.close()


def remote(port: int, transfer_id: str, num_blocks: int | None = None) -> RemoteBlocks:
    return RemoteBlocks(host="127.0.0.1", port=port, transfer_id=transfer_id, num_blocks=num_blocks)
