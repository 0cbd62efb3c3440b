"""The target's answers for `switchyard train-draft`, written by our own engine: continuous batching over many
prompts at once, with the final normed hidden states of every position recorded as the engine computes them.

The engine hands hidden states to a proposer that asks for them (`Proposer.observe`); `HiddenRecorder` is such
a proposer that never drafts and keeps them per request. Prefix caching is off, so every position of every
prompt is computed, and observed, once.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from backends.spec.proposer import DraftRequest


class HiddenRecorder:
    """A proposer that drafts nothing and records each request's hidden states, position by position."""

    name = "record"
    cost_per_token = 0.0
    wants_hidden = True

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self._next: dict[str, int] = {}   # per request, the position the next observed row must have

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[] for _ in requests]

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        if start != self._next.get(request_id, 0):   # recomputed from the start (a preemption): begin again
            if start != 0:
                raise RuntimeError(f"request {request_id}: hidden states from {start}, expected "
                                   f"{self._next.get(request_id, 0)}")
            self.rows[request_id] = []
        self.rows.setdefault(request_id, []).append(hidden.detach().float().clone())
        self._next[request_id] = start + int(hidden.shape[0])

    def free(self, request_id: str) -> None:
        return None   # the rows stay until `take`: a finished request is the point

    def take(self, request_id: str) -> torch.Tensor:
        self._next.pop(request_id, None)
        return torch.cat(self.rows.pop(request_id))


def engine_answers(model_dir: Path, prompt_ids: Sequence[list[int]], *, max_new_tokens: int, sample: bool,
                   seed: int, batch_size: int, deadline_s: float | None,
                   on_progress: Callable[[int, int], None] = lambda texts, tokens: None
                   ) -> list[tuple[int, list[int], torch.Tensor]]:
    """(prompt index, prompt + answer token ids, hidden [len - 1, hidden]) per answered prompt, in prompt order.
    `batch_size` sequences run at once; no new prompt starts after `deadline_s` (those running finish)."""
    from backends.engine.config import EngineConfig
    from backends.engine.engine import LLMEngine
    from backends.engine.sampling_params import SamplingParams

    longest = max(len(p) for p in prompt_ids) + max_new_tokens
    blocks_each = -(-longest // 16) + 1
    config = EngineConfig(model_dir=str(model_dir), dtype="float32", device="cpu", block_size=16,
                          num_blocks=batch_size * blocks_each, max_num_seqs=batch_size,
                          enable_prefix_caching=False)
    recorder = HiddenRecorder()
    engine = LLMEngine(config, model_dir=model_dir, proposer=recorder)
    answers: dict[int, list[int]] = {}
    done: list[tuple[int, list[int], torch.Tensor]] = []
    pending = iter(range(len(prompt_ids)))
    running = 0
    num_tokens = 0

    def add_one() -> bool:
        i = next(pending, None)
        if i is None or (deadline_s is not None and done and time.monotonic() > deadline_s):
            return False
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.7 if sample else 0.0,
                                top_p=0.95 if sample else 1.0, seed=seed + i, speculative=False)
        engine.add_request(str(i), list(prompt_ids[i]), params)
        answers[i] = []
        return True

    while running < batch_size and add_one():
        running += 1
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id)
            answers[i] += out.new_token_ids
            if out.finish_reason is None:
                continue
            running -= 1
            ids = list(prompt_ids[i]) + answers.pop(i)
            hidden = recorder.take(out.request_id)
            if out.error is None and hidden.shape[0] == len(ids) - 1:
                done.append((i, ids, hidden))
                num_tokens += len(ids)
                on_progress(len(done), num_tokens)
            if add_one():
                running += 1
    engine.close()
    return sorted(done, key=lambda d: d[0])


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The user message `text` in the chat template, as token ids (as train-draft's transformers path renders it)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
