"""The requests the tests in tests/backends/disagg/ send, and their unified answers as references: the
`both` worker's text and token ids, and where float32 rounding could have decided them otherwise, judged on
transformers' logits for the same tokens (every run lies within the tolerance of those)."""
from __future__ import annotations

import asyncio
from typing import Any

import torch

from tests.backends.numerics import assert_mostly_clear, logit_tolerance
from tests.backends.pd_http import post
from tests.backends.references import Reference, prompt_ids, reference_of, smollm2_vocabulary

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. The sea is wide and deep, and every wave that reaches the shore tells a story",
    "List three colors:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Quote it exactly. Passage: the quick brown fox jumps over the lazy dog.\nQuote: the quick brown fox",
]
CHATS = [[{"role": "user", "content": "Say hello to a friend in one sentence."}],
         [{"role": "user", "content": "What is two plus two? Explain briefly, please."}]]


def requests() -> list[tuple[dict[str, Any], bool]]:
    """(body, is_chat): greedy and seeded, completions and chat."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append(({"model": "smollm2", "prompt": prompt, "max_tokens": 10, "temperature": 0.0,
                     "return_token_ids": True}, False))
        out.append(({"model": "smollm2", "prompt": prompt, "max_tokens": 10, "temperature": 0.9, "seed": 100 + i,
                     "return_token_ids": True}, False))
    for i, messages in enumerate(CHATS):
        out.append(({"model": "smollm2", "messages": messages, "max_tokens": 10, "temperature": 0.7, "seed": 7 + i,
                     "ignore_eos": True, "return_token_ids": True}, True))
    return out


def unified_references(url: str, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> list[Reference]:
    """Each of `requests()` answered by the unified worker at `url`, as a Reference."""
    tokenizer, eos = smollm2_vocabulary()

    async def collect() -> list[tuple[dict[str, Any], bool, dict[str, Any]]]:
        out = []
        for body, chat in requests():
            status, payload = await post(url, body, chat)
            assert status == 200, payload
            out.append((body, chat, payload))
        return out

    answers = asyncio.run(collect())
    prompts = [prompt_ids(tokenizer, body, chat) for body, chat, _ in answers]
    for prompt, (_, _, payload) in zip(prompts, answers, strict=True):
        assert len(prompt) == payload["usage"]["prompt_tokens"]
    outputs = [payload["choices"][0]["token_ids"] for _, _, payload in answers]
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [p + o for p, o in zip(prompts, outputs, strict=True)])
    refs = [reference_of(body, chat, payload, prompt, hf_smollm2, eos, tolerance)
            for prompt, (body, chat, payload) in zip(prompts, answers, strict=True)]
    assert_mostly_clear([r.choices for r in refs], "the unified worker's tokens")
    return refs
