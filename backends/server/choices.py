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

from backends.core.kv_transfer_params import KVTransferParams
from backends.core.sampling_params import SamplingParams
from backends.server.app_keys import WorkerEngine
from backends.server.errors import invalid_param
from backends.server.generation import (
    GenerationDelta,
    SequenceSpec,
    TokenTimingObserver,
    generate_deltas,
    prior_output_text,
)
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
    """`req.num_choices` sequences of each prompt running, read as stream chunks or as one final body. A resumed
    request (`req.resume_choices`, resume.py) runs each choice on from the tokens the client has of it, and not
    at all a choice the client has whole."""

    def __init__(self, engine: WorkerEngine, tokenizer: PromptTokenizer, timing: TokenTimingObserver,
                 req: GenerateRequest, prompts: list[tuple[tuple[int, ...], SamplingParams]], request_id: str,
                 arrival_s: float) -> None:
        """`prompts`: each prompt's tokens and its sampling parameters (max_tokens resolved for it)."""
        self._engine, self._tokenizer, self._timing = engine, tokenizer, timing
        self.arrival_s = arrival_s
        self._num_choices = n = req.num_choices
        self._num_prompt_tokens = [len(ids) for ids, _ in prompts]
        resumed = req.resume_choices or ((),) * (len(prompts) * n)
        # None: a choice the client has whole (a resumed request), which runs no sequence.
        self._specs = [None if (sent := resumed[k]) is None else _spec(req, f"{request_id}-{k}", k, ids, params, sent,
                                                                       arrival_s)
                       for i, (ids, params) in enumerate(prompts) for k in range(i * n, i * n + n)]
        self._builders = [self._builder(req, request_id, k, spec) for k, spec in enumerate(self._specs)]
        self._queue: asyncio.Queue[tuple[int, GenerationDelta | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        # Each prompt's first choice prefills it alone; the others start once it has (its first delta), so that
        # they take its KV from the prefix cache instead of computing the same prompt side by side.
        self._prefilled = [asyncio.Event() for _ in prompts]
        for prompt, event in enumerate(self._prefilled):
            if self._specs[prompt * n] is None:   # the first choice does not run: none waits for it
                event.set()

    def _builder(self, req: GenerateRequest, request_id: str, k: int, spec: SequenceSpec | None) -> ResponseBuilder:
        prior = spec.prompt_token_ids[len(spec.prompt_token_ids) - spec.num_prior_output_tokens:] if spec else ()
        prior_text = prior_output_text(self._tokenizer.backend, spec) if spec and prior and req.tools else ""
        return ResponseBuilder(req.kind, request_id, req.model, self._tokenizer, return_token_ids=req.return_token_ids,
                               prior_completion_ids=prior, index=k, tools=req.tools, prior_text=prior_text)

    async def __aenter__(self) -> Choices:
        self._tasks = [asyncio.create_task(self._run(k, spec)) for k, spec in enumerate(self._specs) if spec]
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
        bodies = [builder.final(deltas) for builder, deltas, spec in zip(self._builders, collected, self._specs,
                                                                         strict=True) if spec is not None]
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = self._usage().body()
        return body

    def _usage(self) -> Usage:
        """Each prompt (and its cache hits, as its first running choice met them) once, the output tokens of every
        choice that ran (a resumed one's with those the client had)."""
        n, usages = self._num_choices, [b.usage for b in self._builders]
        firsts = [next((u for u, spec in zip(usages[i * n:i * n + n], self._specs[i * n:i * n + n], strict=True)
                        if spec is not None), Usage(num_prompt, 0, 0))
                  for i, num_prompt in enumerate(self._num_prompt_tokens)]
        return Usage(sum(u.num_prompt_tokens for u in firsts), sum(u.num_cached_tokens for u in firsts),
                     sum(u.num_completion_tokens for u in usages))

    async def _deltas(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """(choice, delta) until every choice has finished; a choice's error is raised here."""
        num_running = len(self._tasks)
        while num_running:
            k, item = await self._queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item

    async def _run(self, k: int, spec: SequenceSpec) -> None:
        prompt, choice = divmod(k, self._num_choices)
        prefilled = self._prefilled[prompt]
        try:
            if choice:     # not the prompt's first
                await prefilled.wait()
            async with aclosing(generate_deltas(self._engine, self._tokenizer.backend, spec,
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



def _spec(req: GenerateRequest, sequence_id: str, k: int, prompt_ids: tuple[int, ...], params: SamplingParams,
          resumed: tuple[int, ...], arrival_s: float) -> SequenceSpec:
    """Choice `k`'s sequence: its prompt, then the output the client has of it (`resumed`), as
    openai_routes.py resumes one sequence."""
    if len(resumed) >= params.max_tokens:
        raise invalid_param("resume_token_ids", f"choice {k}: {len(resumed)} resumed tokens leave nothing to generate "
                            f"within max_tokens ({params.max_tokens}).")
    return SequenceSpec(sequence_id, prompt_ids + resumed,
                        dataclasses.replace(params, seed=choice_seed(params.seed, k % req.num_choices)),
                        req.skip_special_tokens, arrival_s, num_prior_output_tokens=len(resumed),
                        kv_transfer=KVTransferParams(first_token_ids=resumed) if resumed else None)
