"""Typed application state of a worker app (`web.AppKey`s) and the one engine surface the server uses."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, TypeVar

from aiohttp import web

from backends.core.block_events import KVEventBatch
from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import LoadReport, SequenceOutput
from backends.core.sampling_params import SamplingParams
from backends.kv_transfer.base import SharedRegion
from backends.server.metrics import ServerMetrics
from backends.server.server_config import ServerConfig
from backends.server.tokenization import PromptTokenizer

if TYPE_CHECKING:
    import torch

    from backends.engine.engine import EngineStats

C = TypeVar("C")


class WorkerEngine(Protocol):
    """What the server needs of `backends.engine.async_engine.AsyncEngine`."""

    max_model_len: int
    block_size: int
    vocab_size: int
    hidden_size: int   # an embedding's length

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def warm_structured_output(self) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        kv_transfer: KVTransferParams | None = None,
    ) -> AsyncIterator[SequenceOutput]: ...

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> SequenceOutput: ...

    async def abort(self, request_id: str) -> None: ...

    def load_report(self) -> LoadReport: ...

    def stats(self) -> EngineStats: ...

    def kv_events(self, since: int, limit: int = 1000) -> KVEventBatch: ...

    def kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def kv_region(self) -> SharedRegion | None: ...

    def weights_fingerprint(self) -> str: ...

    def wake(self) -> None: ...

    def find_kv_connector(self, kind: type[C]) -> C | None: ...

    def failure(self) -> str | None:
        """Why the engine can never step again (a tensor-parallel group lost a rank), or None."""
        ...


CONFIG_KEY = web.AppKey("config", ServerConfig)
ENGINE_KEY = web.AppKey("engine", WorkerEngine)
TOKENIZER_KEY = web.AppKey("tokenizer", PromptTokenizer)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
