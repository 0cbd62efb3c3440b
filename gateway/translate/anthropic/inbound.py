"""Anthropic clients over the OpenAI-style dispatch: a Messages request becomes a chat completions body,
and the chat answer (whole or streamed) and errors come back in Anthropic's shapes.

Pure: no I/O. Bad requests raise `BadRequest` (the /v1/messages route renders it in Anthropic's shape).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from typing import Any, TypeGuard

import orjson

from gateway.errors import BadRequest
from gateway.translate.anthropic import FIRST_VERSION
from gateway.translate.anthropic.inbound_tools import chat_messages as chat_messages_of, chat_tools, tool_use_blocks
from gateway.translate.chat_stream import ChatStreamTranslator
from gateway.translate.sse import named_event

ROLES = frozenset({"user", "assistant"})
# OpenAI finish_reason -> Anthropic stop_reason ("stop" may become "stop_sequence": see `stop_reason`).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}
# HTTP status -> Anthropic error type; any other 4xx is invalid_request_error, any other 5xx api_error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# OpenAI error `type` -> Anthropic's, for errors that arrive inside a stream (no status to go by).
STREAM_ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                      "permission_error": "permission_error", "rate_limit_error": "rate_limit_error"}


@dataclass(frozen=True, slots=True)
class MessageHeader:
    """What every answer to one Messages request carries besides the upstream's text."""
    message_id: str                       # "msg_..." (the gateway makes one per request)
    model: str                            # the model name the client sent
    stop_sequences: tuple[str, ...]       # the client's, to tell a stop sequence from the end of a turn
    num_input_tokens: int = 0             # the gateway's prompt count (message_start), until usage corrects it


# --- the request -------------------------------------------------------------------------------------

def check_version(value: str | None) -> None:
    """`anthropic-version` may be absent; a present one is a YYYY-MM-DD date from FIRST_VERSION on."""
    if value is None:
        return
    try:
        valid = date.fromisoformat(value.strip()).isoformat() == value.strip() and value.strip() >= FIRST_VERSION
    except ValueError:
        valid = False
    if not valid:
        raise BadRequest(f"anthropic-version: {value!r} is not a valid version; expected a date such as "
                         f"2023-06-01 (from {FIRST_VERSION} on)", param="anthropic-version")


def to_chat_body(body: Any) -> dict[str, Any]:
    """A validated Messages request as an OpenAI chat completions body (usage asked for when streaming)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: field required (a non-empty string)", param="model")
    max_tokens = body.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest("max_tokens: field required (an integer of at least 1)", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: field required (a non-empty array)", param="messages")
    chat_messages = []
    if body.get("system") is not None:
        chat_messages.append({"role": "system", "content": _text(body["system"], "system")})
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message["role"] not in ROLES:
            raise BadRequest(f"{where}: an object with role 'user' or 'assistant'", param=f"{where}.role")
        chat_messages += chat_messages_of(message["role"], message.get("content"), f"{where}.content")
    chat: dict[str, Any] = {"model": model, "messages": chat_messages, "max_tokens": max_tokens, **chat_tools(body)}
    last = chat_messages[-1]
    if last["role"] == "assistant":   # a prefilled answer: continued in place, as vLLM takes it
        if last.get("tool_calls"):
            raise BadRequest(f"messages.{len(messages) - 1}: a tool_use must be answered by tool_result blocks in "
                             "a user message after it", param=f"messages.{len(messages) - 1}")
        chat.update(continue_final_message=True, add_generation_prompt=False)
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = _number(body, name)
    if body.get("top_k") is not None:   # vLLM's extension, which switchyard workers accept too
        if not _is_int(body["top_k"]) or body["top_k"] < 0:
            raise BadRequest("top_k: a non-negative integer", param="top_k")
        chat["top_k"] = body["top_k"]
    stop = _stop_sequences(body.get("stop_sequences"))
    if stop:
        chat["stop"] = list(stop)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: a boolean", param="stream")
    if stream:
        chat.update(stream=True, stream_options={"include_usage": True})
    return chat


def stop_sequences(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The request's stop sequences (after `to_chat_body` validated them)."""
    return _stop_sequences(body.get("stop_sequences"))


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest("stop_sequences: an array of non-empty strings", param="stop_sequences")
    return tuple(value)


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (as the workers join OpenAI text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for index, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise BadRequest(f"{where}.{index}: only text content blocks are supported, not {kind!r}",
                                 param=f"{where}.{index}")
            texts.append(block["text"])
        return "\n".join(texts)
    raise BadRequest(f"{where}: a string or a non-empty array of text blocks", param=where)


def _number(body: Mapping[str, Any], name: str) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name}: a number", param=name)
    return value


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


# --- the answer --------------------------------------------------------------------------------------

def stop_reason(choice: Mapping[str, Any], stop_sequences: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of an OpenAI choice. vLLM-style upstreams (switchyard workers too)
    name the stop string that ended the output in the choice's `stop_reason`."""
    finish = choice.get("finish_reason")
    if finish is None:
        return None, None
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn") if isinstance(finish, str) else "end_turn", None


def usage(openai_usage: Any, num_input_tokens: int, num_output_tokens: int) -> dict[str, int]:
    """Anthropic usage from an OpenAI usage object (or the fallbacks when there is none). As Anthropic
    counts, input_tokens excludes the prompt tokens read from the prefix cache; no prompt is ever written
    to the cache at a price, so cache_creation_input_tokens is 0."""
    cached = 0
    if isinstance(openai_usage, dict):
        prompt, completion = openai_usage.get("prompt_tokens"), openai_usage.get("completion_tokens")
        num_input_tokens = prompt if _is_int(prompt) else num_input_tokens
        num_output_tokens = completion if _is_int(completion) else num_output_tokens
        details = openai_usage.get("prompt_tokens_details")
        if isinstance(details, dict) and _is_int(details.get("cached_tokens")):
            cached = min(details["cached_tokens"], num_input_tokens)
    return {"input_tokens": num_input_tokens - cached, "output_tokens": num_output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def to_message(completion: Any, header: MessageHeader) -> dict[str, Any]:
    """A whole OpenAI chat completion as an Anthropic message."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    text = message.get("content")
    text = text if isinstance(text, str) else ""
    calls = tool_use_blocks(message)
    content = ([{"type": "text", "text": text}] if text or not calls else []) + calls
    reason, sequence = stop_reason(choice, header.stop_sequences)
    return {"id": header.message_id, "type": "message", "role": "assistant", "model": header.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(completion.get("usage") if isinstance(completion, dict) else None,
                           header.num_input_tokens, 0)}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_from_openai(status: int, body: bytes) -> dict[str, Any]:
    """An upstream's OpenAI-style error (relayed as it was) in Anthropic's shape."""
    return error_body(status, _openai_message(body))


def _openai_message(body: bytes) -> str:
    try:
        message = orjson.loads(body)["error"]["message"]
        if isinstance(message, str):
            return message
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    return body[:500].decode(errors="replace")


# --- the stream --------------------------------------------------------------------------------------

class MessageEvents(ChatStreamTranslator):
    """OpenAI chat chunks in, Anthropic stream events out: message_start first; a content block per run of
    text (`text_delta`s) and per tool call (`tool_use`, its arguments as `input_json_delta`s), each started
    when its first piece comes and stopped when the next starts, a ping after the first block's start; then
    message_delta (stop reason and usage) and message_stop at [DONE]. An answer with no content gets one
    empty text block. A keepalive comment becomes a ping; an error event becomes `event: error` and ends
    the stream."""

    __slots__ = ("_block", "_header", "_in_call", "_num_blocks", "_tool_blocks")

    def __init__(self, header: MessageHeader) -> None:
        super().__init__()
        self._header = header
        self._block: int | None = None        # the index of the open content block
        self._in_call = False                 # the open block is a tool call's
        self._num_blocks = 0
        self._tool_blocks: dict[int, int] = {}   # tool call number -> its block's index

    def _keepalive(self) -> bytes:
        return named_event({"type": "ping"})

    def _text(self, text: str) -> bytes:
        out = self._open_block({"type": "text", "text": ""}) if self._block is None or self._in_call else b""
        return out + named_event({"type": "content_block_delta", "index": self._block,
                                  "delta": {"type": "text_delta", "text": text}})

    def _tool_call(self, number: int, call_id: str, name: str) -> bytes:
        out = self._open_block({"type": "tool_use", "id": call_id, "name": name, "input": {}}, in_call=True)
        assert self._block is not None
        self._tool_blocks[number] = self._block
        return out

    def _tool_arguments(self, number: int, piece: str) -> bytes:
        return named_event({"type": "content_block_delta", "index": self._tool_blocks[number],
                            "delta": {"type": "input_json_delta", "partial_json": piece}})

    def _open_block(self, block: dict[str, Any], in_call: bool = False) -> bytes:
        out = self._close_block()
        self._block, self._in_call = self._num_blocks, in_call
        self._num_blocks += 1
        out += named_event({"type": "content_block_start", "index": self._block, "content_block": block})
        return out + named_event({"type": "ping"}) if self._block == 0 else out

    def _close_block(self) -> bytes:
        if self._block is None:
            return b""
        index, self._block = self._block, None
        return named_event({"type": "content_block_stop", "index": index})

    def _opening(self) -> bytes:
        header = self._header
        message: dict[str, Any] = {
            "id": header.message_id, "type": "message", "role": "assistant", "model": header.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(None, header.num_input_tokens, 0)}
        return named_event({"type": "message_start", "message": message})

    def _closing(self) -> bytes:
        reason, sequence = stop_reason(self._finish, self._header.stop_sequences)
        out = self._open_block({"type": "text", "text": ""}) if self._num_blocks == 0 else b""
        return (out + self._close_block()
                + named_event({"type": "message_delta", "delta": {"stop_reason": reason or "end_turn",
                                                                   "stop_sequence": sequence},
                               "usage": usage(self._usage, self._header.num_input_tokens, self._num_deltas)})
                + named_event({"type": "message_stop"}))

    def _failure(self, error: Mapping[str, Any]) -> bytes:
        kind = "overloaded_error" if error.get("code") == "no_upstream_available" else \
            STREAM_ERROR_TYPES.get(str(error.get("type")), "api_error")
        message = error.get("message") if isinstance(error.get("message"), str) else "upstream error"
        return named_event({"type": "error", "error": {"type": kind, "message": message}})
