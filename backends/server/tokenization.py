"""Prompt tokenization for the worker: text prompts, token-id prompts and chat templates.

Wraps the model folder's Hugging Face tokenizer; detokenization of outputs lives in
`detokenizer.py` and works on the Rust tokenizer this exposes as `backend`.
"""
from __future__ import annotations

from pathlib import Path

import jinja2
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from backends.server.errors import invalid_param
from backends.server.protocol import GenerateRequest, RequestKind


class PromptTokenizer:
    """Turns a validated request into prompt token ids."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ValueError("the model needs a fast (tokenizers-backed) tokenizer")
        self._hf = hf_tokenizer
        self._backend = backend

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PromptTokenizer:
        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    @property
    def backend(self) -> Tokenizer:
        """The Rust tokenizer (for incremental detokenization and token strings)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    def encode_request(self, req: GenerateRequest) -> tuple[int, ...]:
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        if req.kind is RequestKind.CHAT:
            return self._encode_chat(req)
        return tuple(self._hf(req.prompt_text or "")["input_ids"])

    def _encode_chat(self, req: GenerateRequest) -> tuple[int, ...]:
        messages = [{"role": m.role, "content": m.content} for m in req.messages or ()]
        try:
            text = self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (jinja2.TemplateError, ValueError) as exc:
            raise invalid_param("messages", f"The chat template refused the messages: {exc}") from exc
        # The template already wrote the special tokens (BOS, role markers): add none.
        return tuple(self._hf(text, add_special_tokens=False)["input_ids"])
