"""Text continuation of several choices in one leg, for engines that take text only (any OpenAI-compatible
one): on /v1/completions, a batch holding, for each unfinished choice, its prompt followed by its text so far
(`n` = 1); and the rewriting of that leg's choices back into the client's (index, own budget, usage).
Chat has no batch (one leg per choice would be needed), so it does not continue several chat choices.
It never reads transcripts nor sends anything (mid_stream_resume.py and the providers do).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gateway.upstream.so_far import SoFar

OUTPUT_LIMIT = "max_tokens"      # the completions API's one output limit, for every choice alike


@dataclass(frozen=True, slots=True)
class TextBatch:
    """How a text continuation of several choices is sent, and read back."""
    indices: tuple[int, ...]              # the client's choice index of each prompt of the leg, in order
    prompts: tuple[str, ...]              # each leg prompt: its choice's prompt, then its text so far
    max_tokens: tuple[int | None, ...]    # each leg prompt's own output budget left (None: no limit)
    num_moved: int                        # output tokens so far of the continued choices (in the leg's prompts)
    prompt_share: float                   # the client's prompts over the leg's, by weight (see `text_batch`)


def text_batch(body: Mapping[str, Any], so_far: SoFar) -> TextBatch | None:
    """The batch that continues `so_far` of a completions request `body` (the client's index of prompt p's
    sample k is p * n + k); None when text cannot: token-id prompts, tool calls, a choice out of budget.

    The leg counts each of its prompts, the client's request each prompt once: the leg's prompt tokens
    (less the text so far) are scaled by each prompt's share, weighed by its characters (+ 1, so that an empty
    prompt counts). Exact whenever every prompt is continued as many times (n = 1 with all unfinished, or all of
    one prompt's samples); otherwise an estimate, as any text continuation's usage is."""
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    n = body.get("n") or 1
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts) or \
            len(prompts) * n != len(so_far.choices) or any(c.calls for c in so_far.choices):
        return None
    limit = body.get(OUTPUT_LIMIT)
    indices = tuple(i for i, c in enumerate(so_far.choices) if not c.finished)
    budgets = tuple(limit - so_far.choices[i].num_tokens if isinstance(limit, int) else None for i in indices)
    if any(b is not None and b <= 0 for b in budgets):
        return None    # its last token was sent, its finish_reason not: nothing to ask for
    weight = sum(len(prompts[i // n]) + 1 for i in indices)
    return TextBatch(indices, tuple(prompts[i // n] + so_far.choices[i].text for i in indices), budgets,
                     sum(so_far.choices[i].num_tokens for i in indices),
                     sum(len(p) + 1 for p in prompts) / weight)


def batch_body(out: dict[str, Any], batch: TextBatch) -> dict[str, Any]:
    """`out` sending `batch`: one limit for all, the largest budget (each choice is held to its own by
    `BatchRewrite`); `best_of` goes, as `n` does (each leg prompt is one sample already)."""
    out = {k: v for k, v in out.items() if k != "best_of"}
    out.update(prompt=list(batch.prompts), n=1)
    if all(b is not None for b in batch.max_tokens):
        out[OUTPUT_LIMIT] = max(b for b in batch.max_tokens if b is not None)
    return out


class BatchRewrite:
    """Maps a text batch's choices back onto the client's: index, a choice stopped at its own budget
    ("length": what the engine sends past it is dropped), usage over both legs."""

    __slots__ = ("_batch", "_num_dropped", "_num_sent", "_num_so_far", "_whole")

    def __init__(self, batch: TextBatch, so_far: SoFar) -> None:
        self._batch = batch
        self._num_so_far = so_far.num_tokens          # every choice's output so far, whole ones' too
        self._num_sent = [0] * len(batch.indices)     # by leg index: content events passed on
        self._whole: set[int] = set()                 # leg indices whose finish_reason was passed on
        self._num_dropped = 0                         # content events dropped after their choice was whole

    def choices(self, choices: list[Any]) -> list[Any]:
        """The leg's `choices` as the client's; those of a choice already whole left out."""
        out = []
        for choice in choices:
            index = choice.get("index", 0) if isinstance(choice, dict) else None
            if not isinstance(index, int) or not 0 <= index < len(self._batch.indices):
                out.append(choice)
                continue
            if index in self._whole:
                self._num_dropped += 1 if choice.get("text") else 0
                continue
            choice["index"] = self._batch.indices[index]
            if choice.get("text"):
                self._num_sent[index] += 1
                if self._num_sent[index] == self._batch.max_tokens[index] and choice.get("finish_reason") is None:
                    choice["finish_reason"] = "length"     # its own budget, smaller than the leg's
            if choice.get("finish_reason") is not None:
                self._whole.add(index)
            out.append(choice)
        return out

    def read_back(self, leg: SoFar) -> SoFar:
        """`leg` (this batch's leg, read at its own indices) at the client's indices; a choice stopped at its
        budget is whole, with the tokens the client got (its text may run past them: nothing continues it)."""
        choices = [replace(c, text="", token_ids=(), num_tokens=0, finished=False, calls=False)
                   for c in leg.choices]
        for j, index in enumerate(self._batch.indices):
            got = leg.choices[j]
            choices[index] = replace(got, num_tokens=self._num_sent[j], finished=got.finished or j in self._whole)
        return replace(leg, choices=tuple(choices))

    def usage(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            usage["prompt_tokens"] = round(max(0, prompt - self._batch.num_moved) * self._batch.prompt_share)
            usage["completion_tokens"] = completion - self._num_dropped + self._num_so_far
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
