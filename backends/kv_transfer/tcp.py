"""`TcpTransport`: switchyard's own KV transport, plain TCP with the framing in protocol.py, and a
shared-memory copy instead of the LAYER stream when both workers share a host (shm.py).

A prefill worker calls `serve`; a decode worker calls `pull` (and `release` when the pull
did not already release). The engine sits behind `KVBlockSource`/`KVBlockSink` only.
"""
from __future__ import annotations

from collections.abc import Sequence

from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer.base import KVBlockSink, KVBlockSource, KVTransferConfig, KVTransport, PullResult
from backends.kv_transfer.shm import SharedMappings, SharedPull
from backends.kv_transfer.tcp_client import pull_blocks, release_blocks
from backends.kv_transfer.tcp_server import TcpKVServer
from backends.kv_transfer.torch_cache import TorchPagedKV


class TcpTransport(KVTransport):
    def __init__(self, config: KVTransferConfig | None = None) -> None:
        self.config = config or KVTransferConfig()
        self._server: TcpKVServer | None = None
        self._mappings = SharedMappings()

    async def serve(self, source: KVBlockSource, host: str, port: int) -> tuple[str, int]:
        if self._server is not None:
            raise RuntimeError("this transport is already serving")
        server = TcpKVServer(source, self.config)
        address = await server.start(host, port)
        self._server = server
        return address

    async def pull(self, remote: RemoteBlocks, sink: KVBlockSink,
                   block_ids: Sequence[int], start_block: int = 0) -> PullResult:
        shared = None
        if (self.config.shared_memory and isinstance(sink, TorchPagedKV) and sink.device.type == "cpu"
                and self._mappings.wanted(remote.host, remote.port)):
            shared = SharedPull(self._mappings, sink.layers, block_ids, sink.layout(), remote.host, remote.port)
        return await pull_blocks(remote, sink, block_ids, start_block, self.config, shared)

    async def release(self, remote: RemoteBlocks) -> bool:
        return await release_blocks(remote, self.config)

    async def close(self) -> None:
        self._mappings.close()
        if self._server is not None:
            await self._server.close()
            self._server = None
