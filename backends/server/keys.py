"""Typed application state of a worker app (`web.AppKey`s) and the engine surface the server uses."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import web

from backends.engine.outputs import SequenceOutput
from backends.engine.sampling_params import SamplingParams
from backends.server.config import ServerConfig
from backends.server.metrics import ServerMetrics
from backends.server.tokenization import PromptTokenizer


class WorkerEngine(Protocol):
    """What the server needs of `backends.engine.async_engine.AsyncEngine`."""

    max_model_len: int
    block_size: int
    vocab_size: int

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SequenceOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def load_report(self) -> Any: ...

    def stats(self) -> Any: ...

    def kv_events(self, since: int, limit: int = 1000) -> Any: ...


CONFIG_KEY = web.AppKey("config", ServerConfig)
ENGINE_KEY = web.AppKey("engine", WorkerEngine)
TOKENIZER_KEY = web.AppKey("tokenizer", PromptTokenizer)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
