"""Prompt tokenization for the worker: text prompts, token-id prompts and chat templates.

Wraps the model folder's Hugging Face tokenizer; detokenization of outputs lives in
`detokenizer.py` and works on the Rust tokenizer this exposes as `backend`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from backends.models.model_config import read_config_json
from backends.server.errors import invalid_param
from backends.server.protocol import ChatMessage, GenerateRequest, RequestKind
from backends.structured_output.token_bytes import TokenBytes


class PromptTokenizer:
    """Turns a validated request into prompt token ids."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ValueError("the model needs a fast (tokenizers-backed) tokenizer")
        self._hf = hf_tokenizer
        self._backend = backend
        self.token_bytes = TokenBytes(backend)   # each token's own bytes (chat logprobs)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PromptTokenizer:
        return cls(AutoTokenizer.from_pretrained(str(model_dir), **_plain_config(Path(model_dir))))

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
        return self.encode_text(req.prompt_text or "")

    def encode_text(self, text: str) -> tuple[int, ...]:
        """A plain text prompt (/v1/completions, /v1/embeddings): the tokenizer's own special tokens added."""
        return tuple(self._hf(text)["input_ids"])

    def _encode_chat(self, req: GenerateRequest) -> tuple[int, ...]:
        messages = [_template_message(m) for m in req.messages or ()]
        tools: list[Any] | None = list(req.tools.tools) if req.tools is not None else None
        try:
            text = self._hf.apply_chat_template(messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                                continue_final_message=req.continue_final_message, tokenize=False)
        except (jinja2.TemplateError, ValueError) as exc:
            raise invalid_param("messages", f"The chat template refused the messages: {exc}") from exc
        # The template already wrote the special tokens (BOS, role markers): add none.
        return tuple(self._hf(text, add_special_tokens=False)["input_ids"])


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's tool calls and a tool answer's call id included."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = list(message.tool_calls)
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _plain_config(model_dir: Path) -> dict[str, Any]:
    """AutoTokenizer's `config` argument, when a plain one will do: AutoTokenizer picks the class from
    tokenizer_config.json's `tokenizer_class` and the config's model_type and name, and given no config
    it reads them through the model's config class, whose import costs 1.5 s of a worker start (see
    backends.models.model_config). A plain PretrainedConfig of config.json carries the same three. Not when
    tokenizer_config.json names no class or custom code: AutoTokenizer then looks the class up by the
    config class itself."""
    try:
        with open(model_dir / "tokenizer_config.json", encoding="utf-8") as file:
            tokenizer_config = json.load(file)
        data = read_config_json(model_dir)
    except (OSError, ValueError):
        return {}
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config or not data.get("model_type"):
        return {}
    config = PretrainedConfig(**data)
    config._name_or_path = str(model_dir)   # what AutoConfig sets: AutoTokenizer matches model ids on it
    return {"config": config}
