"""A request for `n` > 1 choices: n sequences of one prompt, generated side by side in the engine's batch and
answered as one response whose choices carry their index (their chunks interleave as they come when
streamed). The prompt is counted once in usage, every choice's output tokens. A seeded request samples choice
k with seed + k: reproducible, and its choices differ.

Any way the response ends (answered, client gone, one choice refused) ends every sequence in the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import TracebackType
from typing import Any

from backends.engine.sampling_params import SamplingParams
from backends.server.generation import GenerationDelta, SequenceSpec, TokenTimingObserver, generate_deltas
from backends.server.keys import WorkerEngine
from backends.server.protocol import GenerateRequest
from backends.server.responses import ResponseBuilder, combined_usage
from backends.server.tokenization import PromptTokenizer

_SEED_SPAN = 2**64   # seeds wrap within what SamplingParams accepts: [-(2**63), 2**64)
_SEED_MAX = 2**64 - 1


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: None stays None (each sequence draws its own at arrival)."""
    if seed is None:
        return None
    seed += index
    return seed - _SEED_SPAN if seed > _SEED_MAX else seed


class Choices:
    """`req.num_choices` sequences of `prompt_ids` running, read as stream chunks or as one final body."""

    def __init__(self, engine: WorkerEngine, tokenizer: PromptTokenizer, timing: TokenTimingObserver,
                 req: GenerateRequest, prompt_ids: tuple[int, ...], params: SamplingParams, request_id: str,
                 arrival_s: float) -> None:
        self._engine, self._tokenizer, self._timing = engine, tokenizer, timing
        self.arrival_s = arrival_s
        self._specs = [
            SequenceSpec(f"{request_id}-{k}", prompt_ids, dataclasses.replace(params, seed=choice_seed(params.seed, k)),
                         req.skip_special_tokens, arrival_s)
            for k in range(req.num_choices)]
        self._builders = [ResponseBuilder(req.kind, request_id, req.model, tokenizer.backend,
                                          return_token_ids=req.return_token_ids, index=k)
                          for k in range(req.num_choices)]
        self._queue: asyncio.Queue[tuple[int, GenerationDelta | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Choices:
        self._tasks = [asyncio.create_task(self._run(k)) for k in range(len(self._specs))]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for task in self._tasks:
            task.cancel()    # closing its generator aborts the sequence in the engine
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Each choice's stream chunks, interleaved as the deltas come."""
        async for k, delta in self._deltas():
            yield self._builders[k].chunk(delta)

    def usage_chunk(self) -> dict[str, Any]:
        return self._builders[0].usage_chunk(combined_usage([b.usage for b in self._builders]))

    async def final(self) -> dict[str, Any]:
        """The non-streaming body: every choice, in index order, and the request's usage."""
        collected: list[list[GenerationDelta]] = [[] for _ in self._specs]
        async for k, delta in self._deltas():
            collected[k].append(delta)
        bodies = [builder.final(deltas) for builder, deltas in zip(self._builders, collected, strict=True)]
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = combined_usage([b.usage for b in self._builders]).body()
        return body

    async def _deltas(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """(choice, delta) until every choice has finished; a choice's error is raised here."""
        num_running = len(self._specs)
        while num_running:
            k, item = await self._queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item

    async def _run(self, k: int) -> None:
        try:
            async with aclosing(generate_deltas(self._engine, self._tokenizer.backend, self._specs[k],
                                                self._timing)) as deltas:
                async for delta in deltas:
                    self._queue.put_nowait((k, delta))
        except Exception as exc:  # noqa: BLE001 - raised again in the reader, as one sequence would raise it
            self._queue.put_nowait((k, exc))
            return
        self._queue.put_nowait((k, None))

