"""`TcpTransport`: switchyard's own KV transport, plain TCP with the framing in protocol.py, and a direct
copy instead of the LAYER stream when both workers share a host (shared memory, shm.py) or a GPU (CUDA
IPC, cuda_ipc.py).

A prefill worker calls `serve`; a decode worker calls `pull` (and `release` when the pull
did not already release). The engine sits behind `KVBlockSource`/`KVBlockSink` only.
"""
from __future__ import annotations

from collections.abc import Sequence

from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer.base import KVBlockSink, KVBlockSource, KVTransferConfig, KVTransport, PullResult
from backends.kv_transfer.cuda_ipc import CudaIpcMappings, CudaIpcPull
from backends.kv_transfer.shm import SharedMappings, SharedPull
from backends.kv_transfer.tcp_client import SharedCopier, pull_blocks
from backends.kv_transfer.tcp_release import release_blocks
from backends.kv_transfer.tcp_server import RefusalHook, TcpKVServer
from backends.kv_transfer.torch_cache import TorchPagedKV


class TcpTransport(KVTransport):
    def __init__(self, config: KVTransferConfig | None = None, on_refused: RefusalHook | None = None) -> None:
        """`on_refused`: told of each connection the listener refused for want of the key (the worker counts them)."""
        self.config = config or KVTransferConfig()
        self._on_refused = on_refused
        self._server: TcpKVServer | None = None
        self._mappings = SharedMappings()
        self._cuda_mappings = CudaIpcMappings()

    async def serve(self, source: KVBlockSource, host: str, port: int) -> tuple[str, int]:
        if self._server is not None:
            raise RuntimeError("this transport is already serving")
        server = TcpKVServer(source, self.config, self._on_refused)
        address = await server.start(host, port)
        self._server = server
        return address

    async def pull(self, remote: RemoteBlocks, sink: KVBlockSink,
                   block_ids: Sequence[int], start_block: int = 0) -> PullResult:
        return await pull_blocks(remote, sink, block_ids, start_block, self.config,
                                 self._direct_copier(remote, sink, block_ids))

    def _direct_copier(self, remote: RemoteBlocks, sink: KVBlockSink,
                       block_ids: Sequence[int]) -> SharedCopier | None:
        """How this pull may copy from the server's cache directly: a CPU cache through shared memory, a CUDA
        cache through CUDA IPC; None where neither applies (the pull streams over TCP)."""
        if not (self.config.shared_memory and isinstance(sink, TorchPagedKV)):
            return None
        where = (remote.host, remote.port)
        if sink.device.type == "cpu" and self._mappings.wanted(*where):
            return SharedPull(self._mappings, sink.layers, block_ids, sink.layout(), *where)
        if sink.device.type == "cuda" and self._cuda_mappings.wanted(*where):
            return CudaIpcPull(self._cuda_mappings, sink.layers, block_ids, sink.layout(), *where)
        return None

    async def release(self, remote: RemoteBlocks) -> bool:
        return await release_blocks(remote, self.config)

    async def close(self) -> None:
        self._mappings.close()
        self._cuda_mappings.close()
        if self._server is not None:
            await self._server.close()
            self._server = None
