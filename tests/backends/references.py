"""A real worker's answer as the reference other runs must repeat, and where float32 rounding could have
drawn another token (judged on transformers' logits for the same tokens: tests/backends/numerics.py).
Building and checking references only: starting workers and sending requests stay with the tests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from backends.core.sampling_params import SamplingParams
from tests.backends.numerics import Choice, assert_same_tokens, choices, teacher_forced_logits


@dataclass(frozen=True)
class Reference:
    body: dict[str, Any]       # the request
    chat: bool                 # /v1/chat/completions, not /v1/completions
    text: str                  # the reference worker's answer
    ids: list[int]             # its token ids
    choices: list[Choice]      # where float32 rounding could have drawn another token

    def check(self, ids: list[int], text: str | None, what: str) -> bool:
        """`ids` (and `text`, when given) are this answer's, up to a position rounding decides; True if whole."""
        same = assert_same_tokens(ids, self.ids, self.choices, what)
        if same and text is not None:
            assert text == self.text, what
        return same


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed"),
                          ignore_eos=body.get("ignore_eos", False))


def text_of(choice: dict[str, Any]) -> str:
    """The text of one choice: a whole chat message, a streamed delta, or a completion."""
    if "message" in choice:
        return choice["message"]["content"]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice["text"]


def smollm2_vocabulary() -> tuple[PreTrainedTokenizerBase, tuple[int, ...]]:
    """The bundled SmolLM2's tokenizer as the worker loads it, and its EOS token ids."""
    from transformers import AutoTokenizer

    from backends.engine.engine import eos_token_ids
    from backends.models.model_config import load_model_config
    from backends.worker.loader import resolve_model

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer, eos_token_ids(load_model_config(model_dir), model_dir)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, body: dict[str, Any], chat: bool) -> list[int]:
    """The request's prompt tokens, as the worker tokenizes them."""
    if chat:
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(body["prompt"])["input_ids"]


def reference_of(body: dict[str, Any], chat: bool, payload: dict[str, Any], prompt: list[int],
                 hf_model: torch.nn.Module, eos: tuple[int, ...], tolerance: float) -> Reference:
    """The worker's answer `payload` to `body` (sent with return_token_ids) as a Reference; `prompt` is its
    prompt's tokens, `tolerance` the float32 rounding measured on them (numerics.logit_tolerance)."""
    output = payload["choices"][0]["token_ids"]
    params = sampling_params(body)
    logits = teacher_forced_logits(hf_model, prompt, output)
    return Reference(body, chat, text_of(payload["choices"][0]), output,
                     choices(logits, params, params.seed, eos, tolerance, prompt))
