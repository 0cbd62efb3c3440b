"""One sequence through the engine, seen as text deltas: detokenization, stop strings, abort.

The only place the server iterates `AsyncEngine.generate`. Whatever way the caller stops
iterating (finished, stop string, client gone, error), the sequence is aborted in the engine.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from tokenizers import Tokenizer

from backends.core.engine_errors import EngineRequestError
from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import FinishReason, SequenceOutput, TokenLogprob
from backends.core.sampling_params import SamplingParams
from backends.server.app_keys import WorkerEngine
from backends.server.detokenizer import StopStringDetokenizer
from backends.server.errors import APIError, ErrorType

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0


class TokenTimingObserver(Protocol):
    """Receives token timing (metrics.py implements it)."""

    def observe_first_token(self, ttft_s: float) -> None: ...

    def observe_next_token(self, itl_s: float) -> None: ...


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    text: str                                   # new text safe to send (may be empty)
    token_ids: tuple[int, ...]                  # output tokens this delta accounts for
    logprobs: tuple[TokenLogprob, ...] | None   # parallel to token_ids when logprobs were asked for
    finish_reason: FinishReason | None          # set on the last delta only
    num_prompt_tokens: int                      # prompt length as the engine counted it
    num_cached_tokens: int                      # prompt tokens served from the prefix cache
    stop_string: str | None = None              # the stop string that ended the output (vLLM's stop_reason)


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    request_id: str                   # engine-unique id of the sequence
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams            # validated, max_tokens resolved
    skip_special_tokens: bool         # special tokens stay out of the text
    arrival_s: float                  # time.monotonic() when the request arrived (for TTFT)
    num_prior_output_tokens: int = 0  # a decode leg or a resumed stream: the prompt ends with this many output
                                      # tokens another worker sampled and sent (stop strings may span them and ours)
    continues_elsewhere: bool = False # a prefill leg: at a length finish, hold back text that may begin a
                                      # stop string; the decode leg, seeded with the same tokens, sends it
    kv_transfer: KVTransferParams | None = None   # a disaggregated leg's part in the KV transfer


async def generate_deltas(
    engine: WorkerEngine,
    tokenizer: Tokenizer,
    spec: SequenceSpec,
    timing: TokenTimingObserver,
) -> AsyncGenerator[GenerationDelta, None]:
    """Yield text deltas for one sequence until it finishes; abort it in the engine otherwise.

    Raises APIError (400) when the engine refuses the request; close the iterator with
    `contextlib.aclosing` so that an early exit aborts the sequence at once.
    """
    detok, _ = _detokenizer(tokenizer, spec)
    outputs = _start(engine, spec)
    engine_finished = False   # the engine ended the sequence itself: nothing to abort
    last_s: float | None = None
    try:
        async for out in outputs:
            now = time.monotonic()
            if last_s is None:
                timing.observe_first_token(now - spec.arrival_s)
            else:
                timing.observe_next_token(now - last_s)
            last_s = now
            engine_finished = out.finish_reason is not None
            delta = _to_delta(out, detok, spec.continues_elsewhere)
            yield delta
            if delta.finish_reason is not None:
                return
        raise APIError("The engine ended the sequence without a finish reason.",
                       status=HTTPStatus.INTERNAL_SERVER_ERROR, error_type=ErrorType.SERVER)
    finally:
        await _close(outputs)
        if not engine_finished:
            await _abort(engine, spec.request_id)


def prior_output_text(tokenizer: Tokenizer, spec: SequenceSpec) -> str:
    """The text the output so far (`num_prior_output_tokens`) gave the client: what its safe text was when
    another worker sent it. Raises APIError as `generate_deltas` would for those tokens."""
    return _detokenizer(tokenizer, spec)[1]


def _detokenizer(tokenizer: Tokenizer, spec: SequenceSpec) -> tuple[StopStringDetokenizer, str]:
    """A detokenizer in the state the output so far left it, and that output's text: for a decode leg, the
    prefill leg's tokens are pushed and their safe text counted as sent (what the prefill leg answered)."""
    k = spec.num_prior_output_tokens
    context = spec.prompt_token_ids[:len(spec.prompt_token_ids) - k]
    detok = StopStringDetokenizer(tokenizer, spec.params.stop, skip_special_tokens=spec.skip_special_tokens,
                                  prompt_token_ids=context)
    if not k:
        return detok, ""
    if _push_until_stop(detok, spec.prompt_token_ids[-k:]) and detok.stopped:
        param = "resume_token_ids" if spec.kv_transfer is None or spec.kv_transfer.remote is None \
            else "kv_transfer_params"
        raise APIError("The first tokens already complete a stop string: there is nothing to decode.",
                       param=param, code="invalid_value")
    return detok, detok.take()


def _start(engine: WorkerEngine, spec: SequenceSpec) -> AsyncIterator[SequenceOutput]:
    try:
        prompt = spec.prompt_token_ids[:len(spec.prompt_token_ids) - spec.num_prior_output_tokens]
        return engine.generate(spec.request_id, list(prompt), spec.params, spec.kv_transfer)
    except EngineRequestError as exc:   # refused at once (prompt too long for the context...)
        raise APIError(str(exc) or "The engine refused the request.", param="prompt",
                       code="invalid_value") from exc


async def _abort(engine: WorkerEngine, request_id: str) -> None:
    """Abort and wait until the blocks are free, but never hang a handler on a stuck engine."""
    try:
        await asyncio.wait_for(engine.abort(request_id), ABORT_TIMEOUT_S)
    except TimeoutError:
        log.error("engine did not confirm the abort of %s within %.0fs", request_id, ABORT_TIMEOUT_S)


async def _close(outputs: AsyncIterator[SequenceOutput]) -> None:
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()


def _to_delta(out: SequenceOutput, detok: StopStringDetokenizer, continues: bool) -> GenerationDelta:
    if out.error is not None:
        raise APIError(f"The engine failed the sequence: {out.error}",
                       status=HTTPStatus.INTERNAL_SERVER_ERROR, error_type=ErrorType.SERVER)
    if out.finish_reason is FinishReason.ABORT:
        raise APIError("The sequence was aborted by the engine.",
                       status=HTTPStatus.SERVICE_UNAVAILABLE, error_type=ErrorType.UNAVAILABLE)
    num_kept = _push_until_stop(detok, out.new_token_ids)
    finish = FinishReason.STOP if detok.stopped else out.finish_reason
    held_back = finish is None or (continues and finish is FinishReason.LENGTH)
    text = detok.take() if held_back else detok.finish()
    logprobs = out.logprobs[:num_kept] if out.logprobs is not None else None
    return GenerationDelta(
        text=text,
        token_ids=tuple(out.new_token_ids[:num_kept]),
        logprobs=logprobs,
        finish_reason=finish,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        stop_string=detok.matched_stop,
    )


def _push_until_stop(detok: StopStringDetokenizer, token_ids: Sequence[int]) -> int:
    """Feed tokens to the detokenizer; return how many count (through the one completing a stop)."""
    for i, token_id in enumerate(token_ids):
        if detok.push(token_id):
            return i + 1
    return len(token_ids)
