"""The target's answers for `switchyard train-draft`, with the final normed hidden states of every position: from
our own engine (continuous batching over many prompts at once, the states recorded as the engine computes them),
or from transformers' batched `generate` (a hook on the final norm).

The engine hands hidden states to a proposer that asks for them (`Proposer.observe`); `HiddenRecorder` is such
a proposer that never drafts and keeps them per request. Prefix caching is off, so every position of every
prompt is computed, and observed, once.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backends.speculative.proposer import DraftRequest
from tools.draft_training.train_prompts import Prompt

log = logging.getLogger("switchyard.train_draft")


@dataclass(frozen=True, slots=True)
class Sample:
    kind: str                 # STRUCTURED | PROSE
    token_ids: torch.Tensor   # [n] int64: prompt then the target's answer
    num_prompt_tokens: int    # leading tokens that are the prompt
    hidden: torch.Tensor      # [n - 1, hidden] float32: the target's final normed hidden states (not the last
                              # token's: generation ends before running it)


class HiddenRecorder:
    """A proposer that drafts nothing and records each request's hidden states, position by position."""

    name = "record"
    cost_per_token = 0.0
    wants_hidden = True

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}   # per request, its hidden states from position 0 on

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[] for _ in requests]

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        rows = self.rows.setdefault(request_id, [])
        expected = sum(int(r.shape[0]) for r in rows)
        if start != expected:   # recomputed from the start (a preemption): begin again
            if start != 0:
                raise RuntimeError(f"request {request_id}: hidden states from {start}, expected {expected}")
            rows.clear()
        rows.append(hidden.detach().float().clone())

    def free(self, request_id: str) -> None:
        return None   # the rows stay until `take`: a finished request is the point

    def take(self, request_id: str) -> torch.Tensor:
        return torch.cat(self.rows.pop(request_id))


def engine_answers(model_dir: Path, prompt_ids: Sequence[list[int]], *, max_new_tokens: int, sample: bool,
                   seed: int, batch_size: int, deadline_s: float | None) -> list[tuple[int, list[int], torch.Tensor]]:
    """(prompt index, prompt + answer token ids, hidden [len - 1, hidden]) per answered prompt, in prompt order.
    `batch_size` sequences run at once; no new prompt starts after `deadline_s` (those running finish)."""
    from backends.core.engine_config import EngineConfig
    from backends.core.sampling_params import SamplingParams
    from backends.engine.engine import LLMEngine

    longest = max(len(p) for p in prompt_ids) + max_new_tokens
    blocks_each = -(-longest // 16) + 1
    config = EngineConfig(model_dir=str(model_dir), dtype="float32", device="cpu", block_size=16,
                          num_blocks=batch_size * blocks_each, max_num_seqs=batch_size,
                          enable_prefix_caching=False)
    recorder = HiddenRecorder()
    engine = LLMEngine(config, model_dir=model_dir, proposer=recorder)
    answers: dict[int, list[int]] = {}   # the running requests' tokens so far
    done: list[tuple[int, list[int], torch.Tensor]] = []
    pending = iter(range(len(prompt_ids)))
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

    while len(answers) < batch_size and add_one():
        pass
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id)
            answers[i] += out.new_token_ids
            if out.finish_reason is None:
                continue
            ids = list(prompt_ids[i]) + answers.pop(i)
            hidden = recorder.take(out.request_id)
            if out.error is None and hidden.shape[0] == len(ids) - 1:
                done.append((i, ids, hidden))
                num_tokens += len(ids)
                if len(done) % 32 == 0:
                    log.info("generated %d texts, %d tokens", len(done), num_tokens)
            add_one()
    engine.close()
    return sorted(done, key=lambda d: d[0])


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The user message `text` in the chat template, as token ids (as train-draft's transformers path renders it)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def generate(model: Any, tokenizer: Any, prompts: Sequence[Prompt], max_new_tokens: int,
             sample: bool, seed: int) -> list[Sample]:
    """The target's answers to `prompts` in one batched generate, with the final normed hidden states it
    computed on the way (a hook on the final norm: no second forward)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    normed: list[torch.Tensor] = []   # per forward, [batch, new positions, hidden]
    hook = model.model.norm.register_forward_hook(lambda _m, _i, out: normed.append(out.detach().float()))
    torch.manual_seed(seed)
    try:
        with torch.inference_mode():   # left padding: generate derives positions from the attention mask
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=sample,
                                 temperature=0.7 if sample else None, top_p=0.95 if sample else None,
                                 top_k=None, pad_token_id=tokenizer.pad_token_id)
    finally:
        hook.remove()
    hidden = torch.cat(normed, dim=1)   # [batch, width + steps - 1, hidden]: every token but the last
    width = batch["input_ids"].shape[1]
    samples = []
    for row, prompt in enumerate(prompts):
        pad = int((batch["attention_mask"][row] == 0).sum())
        prompt_ids = batch["input_ids"][row, pad:].tolist()
        answer = out[row, width:].tolist()
        if tokenizer.eos_token_id in answer:
            answer = answer[:answer.index(tokenizer.eos_token_id) + 1]
        ids = prompt_ids + answer
        samples.append(Sample(prompt.kind, torch.tensor(ids), len(prompt_ids),
                              hidden[row, pad:pad + len(ids) - 1].clone()))
    return samples


def collect(model: Any, tokenizer: Any, prompts: Sequence[Prompt], *, batch_size: int, max_new_tokens: int,
            sample: bool, seed: int, deadline_s: float | None) -> list[Sample]:
    """Samples for `prompts` batch by batch, stopping at `deadline_s` (after at least one batch)."""
    samples: list[Sample] = []
    for start in range(0, len(prompts), batch_size):
        if samples and deadline_s is not None and time.monotonic() > deadline_s:
            break
        samples += generate(model, tokenizer, prompts[start:start + batch_size], max_new_tokens, sample, seed + start)
        log.info("generated %d texts, %d tokens", len(samples), sum(len(s.token_ids) for s in samples))
    return samples


def engine_samples(model_dir: Path, tokenizer: Any, prompts: Sequence[Prompt], *, batch_size: int,
                   max_new_tokens: int, seed: int, deadline_s: float) -> list[Sample]:
    """Sampled answers to `prompts` from our engine, with the hidden states it computed."""
    prompt_ids = [chat_prompt_ids(tokenizer, p.text) for p in prompts]
    answered = engine_answers(model_dir, prompt_ids, max_new_tokens=max_new_tokens, sample=True, seed=seed,
                              batch_size=batch_size, deadline_s=deadline_s)
    return [Sample(prompts[i].kind, torch.tensor(ids), len(prompt_ids[i]), hidden) for i, ids, hidden in answered]
