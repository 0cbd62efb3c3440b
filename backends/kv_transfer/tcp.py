"""`TcpKVConnector`: switchyard's own KV transport, plain TCP with the framing in protocol.py.

A prefill worker calls `serve`; a decode worker calls `pull` (and `release` when the pull
did not already release). The engine sits behind `KVBlockSource`/`KVBlockSink` only.
"""
from __future__ import annotations

from collections.abc import Sequence

from backends.kv_transfer.base import (KVBlockSink, KVBlockSource, KVConnector, KVTransferConfig,
                                       PullResult, RemoteBlocks)
from backends.kv_transfer.tcp_client import pull_blocks, release_blocks
from backends.kv_transfer.tcp_server import TcpKVServer


class TcpKVConnector(KVConnector):
    def __init__(self, config: KVTransferConfig | None = None) -> None:
        self.config = config or KVTransferConfig()
        self._server: TcpKVServer | None = None

    async def serve(self, source: KVBlockSource, host: str, port: int) -> tuple[str, int]:
        if self._server is not None:
            raise RuntimeError("this connector is already serving")
        server = TcpKVServer(source, self.config)
        address = await server.start(host, port)
        self._server = server
        return address

    async def pull(self, remote: RemoteBlocks, sink: KVBlockSink,
                   block_ids: Sequence[int], start_block: int = 0) -> PullResult:
        return await pull_blocks(remote, sink, block_ids, start_block, self.config)

    async def release(self, remote: RemoteBlocks) -> bool:
        return await release_blocks(remote, self.config)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None
