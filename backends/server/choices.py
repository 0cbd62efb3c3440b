"""A request of several sequences: `n` > 1 choices of a prompt, or a batch of prompts (n each), generated side by
side in the engine's batch and answered as one response whose choices carry their index, prompt i's choice k
at i * n + k (their chunks interleave as they come when streamed). Each prompt is counted once in usage, every
choice's output tokens. A seeded request samples choice k with seed + k: reproducible, its choices differ,
and a prompt of a batch gets what it would alone.

A prompt's first choice prefills it alone and the others follow once it has, so that they read its KV from the
prefix cache. Any way the response ends (answered, client gone, one choice refused) ends every sequence in the
engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import TracebackType
from typing import Any

from backends.core.sampling_params import SamplingParams
from backends.server.generation import GenerationDelta, SequenceSpec, TokenTimingObserver, generate_deltas
from backends.server.keys import WorkerEngine
from backends.server.protocol import SEED_MAX, GenerateRequest
from backends.server.responses import ResponseBuilder, Usage
from backends.server.tokenization import PromptTokenizer


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: None stays None (each sequence draws its own at arrival)."""
    if seed is None:
        return None
    seed += index     # past SEED_MAX: the same seed modulo 2**64, as the sampler reads it
    return seed - 2**64 if seed > SEED_MAX else seed


class Choices:
    """`req.num_choices` sequences of each prompt running, read as stream chunks or as one final body."""

    def __init__(self, engine: WorkerEngine, tokenizer: PromptTokenizer, timing: TokenTimingObserver,
                 req: GenerateRequest, prompts: list[tuple[tuple[int, ...], SamplingParams]], request_id: str,
                 arrival_s: float) -> None:
        """`prompts`: each prompt's tokens and its sampling parameters (max_tokens resolved for it)."""
        self._engine, self._tokenizer, self._timing = engine, tokenizer, timing
        self.arrival_s = arrival_s
        self._num_choices = n = req.num_choices
        self._specs = [
            SequenceSpec(f"{request_id}-{i * n + k}", ids,
                         dataclasses.replace(params, seed=choice_seed(params.seed, k)), req.skip_special_tokens,
                         arrival_s)
            for i, (ids, params) in enumerate(prompts) for k in range(n)]
        self._builders = [ResponseBuilder(req.kind, request_id, req.model, tokenizer,
                                          return_token_ids=req.return_token_ids, index=index, tools=req.tools)
                          for index in range(len(self._specs))]
        self._queue: asyncio.Queue[tuple[int, GenerationDelta | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        # Each prompt's first choice prefills it alone; the others start once it has (its first delta), so that
        # they take its KV from the prefix cache instead of computing the same prompt side by side.
        self._prefilled = [asyncio.Event() for _ in prompts]

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
        return self._builders[0].usage_chunk(self._usage())

    async def final(self) -> dict[str, Any]:
        """The non-streaming body: every choice, in index order, and the request's usage."""
        collected: list[list[GenerationDelta]] = [[] for _ in self._specs]
        async for k, delta in self._deltas():
            collected[k].append(delta)
        bodies = [builder.final(deltas) for builder, deltas in zip(self._builders, collected, strict=True)]
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = self._usage().body()
        return body

    def _usage(self) -> Usage:
        """Each prompt (and its cache hits, as its first choice met them) once, every choice's output tokens."""
        usages = [b.usage for b in self._builders]
        firsts = usages[::self._num_choices]
        return Usage(sum(u.num_prompt_tokens for u in firsts), sum(u.num_cached_tokens for u in firsts),
                     sum(u.num_completion_tokens for u in usages))

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
        prompt, choice = divmod(k, self._num_choices)
        prefilled = self._prefilled[prompt]
        try:
            if choice:     # not the prompt's first
                await prefilled.wait()
            async with aclosing(generate_deltas(self._engine, self._tokenizer.backend, self._specs[k],
                                                self._timing)) as deltas:
                async for delta in deltas:
                    prefilled.set()
                    self._queue.put_nowait((k, delta))
        except Exception as exc:  # noqa: BLE001 - raised again in the reader, as one sequence would raise it
            self._queue.put_nowait((k, exc))
            return
        finally:
            prefilled.set()     # a first choice that failed or was cancelled holds no one back
        self._queue.put_nowait((k, None))

