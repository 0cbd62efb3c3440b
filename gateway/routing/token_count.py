"""Prompt token counting for routing: the `tokenizers` library on a configured folder's tokenizer.json.

Chat requests are rendered with the folder's chat template (tokenizer_config.json), like the workers
do, so block hashes match theirs. Tokenizers load once per folder; without one, chars/4 is the estimate.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

log = logging.getLogger(__name__)


class PromptTokens(NamedTuple):   # built for every request (policies/base.py: why not a frozen dataclass)
    num_tokens: int                      # prompt tokens (exact with a tokenizer, else estimated)
    token_ids: Sequence[int] | None      # the ids, when a tokenizer produced them (for block hashes)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(pattern: str) -> str:
    return datetime.now().strftime(pattern)


def _environment() -> ImmutableSandboxedEnvironment:
    """What transformers gives a chat template (so the text, and the block hashes, are the workers' and the
    engines'): `tojson` as `json.dumps` spells it, `raise_exception`, `strftime_now` (Llama 3's templates
    print the date), and `{% break %}` / `{% continue %}`."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class ModelTokenizer:
    """One model's tokenizer and chat template."""

    def __init__(self, folder: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._template = None
        self._specials: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").exists():  # where transformers >= 4.43 saves it
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, str):
            self._template = _environment().from_string(template)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            self._specials[name] = value.get("content") if isinstance(value, dict) else value

    def count_chat(self, messages: list[Any], continue_final: bool = False, tools: Any = None) -> PromptTokens:
        """`continue_final`: the answer continues the last message in place (vLLM's `continue_final_message`):
        the rendering ends with its text, as transformers cuts it. `tools` go to the template, which renders
        them where the model expects them (a template without tool use leaves them out, as the engines do)."""
        if self._template is None:
            text = "\n".join(_message_text(m) for m in messages) + _tools_text(tools)
            return self.count_text(text)
        try:
            text = self._template.render(messages=messages, add_generation_prompt=not continue_final,
                                         tools=tools or None, **self._specials)
            final = _message_text(messages[-1]).strip() if continue_final and messages else ""
            if final and final in text:
                text = text[:text.rindex(final) + len(final)]
        except Exception as exc:  # noqa: BLE001 - a template rejecting odd messages must not fail routing
            log.debug("chat template failed (%s); counting plain text", exc)
            text = "\n".join(_message_text(m) for m in messages)
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return PromptTokens(len(ids), ids)

    def count_text(self, text: str) -> PromptTokens:
        ids = self._tokenizer.encode(text).ids
        return PromptTokens(len(ids), ids)


def _message_text(message: Any) -> str:
    """A message's text, and its tool calls' names and arguments."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):  # content parts: count the text ones
        text = " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        text += _tools_text(calls)
    return text


def _tools_text(tools: Any) -> str:
    """Tool definitions or calls as the JSON a template would spell them in."""
    return "\n" + orjson.dumps(tools).decode() if tools else ""


def estimate_chat(messages: list[Any], tools: Any = None) -> PromptTokens:
    num_chars = sum(len(_message_text(m)) + 8 for m in messages)  # ~2 tokens of role framing each
    return PromptTokens(max(1, (num_chars + len(_tools_text(tools))) // 4), None)


def estimate_text(text: str) -> PromptTokens:
    return PromptTokens(max(1, len(text) // 4), None)


class TokenCounter:
    """Counts prompts for every configured model; folders are loaded once and shared."""

    def __init__(self, folders: dict[str, Path | None]) -> None:
        loaded: dict[Path, ModelTokenizer] = {}
        self._by_model: dict[str, ModelTokenizer | None] = {}
        for model, folder in folders.items():
            if folder is None:
                self._by_model[model] = None
                continue
            if folder not in loaded:
                loaded[folder] = ModelTokenizer(folder)
            self._by_model[model] = loaded[folder]

    def count_chat(self, model: str, messages: list[Any], continue_final: bool = False,
                   tools: Any = None) -> PromptTokens:
        tokenizer = self._by_model.get(model)
        return estimate_chat(messages, tools) if tokenizer is None else \
            tokenizer.count_chat(messages, continue_final, tools)

    def count_prompt(self, model: str, prompt: str | list[Any]) -> PromptTokens:
        """A completions prompt: a string, a list of token ids, or a list of strings (a batch)."""
        if isinstance(prompt, list):
            if prompt and all(isinstance(t, int) for t in prompt):
                return PromptTokens(len(prompt), prompt)
            counts = [self.count_prompt(model, p) for p in prompt]
            return PromptTokens(sum(c.num_tokens for c in counts), counts[0].token_ids if len(counts) == 1 else None)
        tokenizer = self._by_model.get(model)
        return estimate_text(prompt) if tokenizer is None else tokenizer.count_text(prompt)
