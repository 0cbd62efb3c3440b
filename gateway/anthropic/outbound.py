"""OpenAI chat requests to an Anthropic-compatible upstream (the `anthropic` provider kind): the chat
body becomes a Messages request, and the upstream's message (whole or streamed) and errors come back as
OpenAI chat completions, chunks and errors.

Pure: no I/O. A body that has no Anthropic form raises `Untranslatable` (the provider hands the request on).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.anthropic.sse import SseEvent, SseFramer, data_event
from gateway.streaming import DONE_EVENT

# Anthropic requires max_tokens; a chat request without one gets this many.
DEFAULT_MAX_TOKENS = 4096
# Anthropic stop_reason -> OpenAI finish_reason.
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                  "refusal": "content_filter", "pause_turn": "stop"}
SYSTEM_ROLES = frozenset({"system", "developer"})


class Untranslatable(Exception):
    """The chat request uses something the Messages API form here does not carry (tools, images, n > 1)."""


def to_messages_request(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI chat completions body as an Anthropic Messages request for `model`."""
    if body.get("n", 1) != 1:
        raise Untranslatable("n > 1")
    if body.get("tools") or body.get("functions"):
        raise Untranslatable("tool use")
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for message in body["messages"]:
        role, text = message.get("role"), _text(message.get("content"))
        if role in SYSTEM_ROLES:
            system.append(text)
        elif role in ("user", "assistant"):
            messages.append({"role": role, "content": text})
        else:
            raise Untranslatable(f"messages with role {role!r}")
    request: dict[str, Any] = {
        "model": model, "messages": messages,
        "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS}
    if system:
        request["system"] = "\n".join(system)
    if body.get("temperature") is not None:
        request["temperature"] = min(float(body["temperature"]), 1.0)  # OpenAI's range is [0, 2]
    for name in ("top_p", "top_k"):
        if body.get(name) is not None:
            request[name] = body[name]
    stop = body.get("stop")
    if stop:
        request["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if isinstance(body.get("user"), str):
        request["metadata"] = {"user_id": body["user"]}
    if body.get("stream"):
        request["stream"] = True
    return request


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Untranslatable("content parts other than text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise Untranslatable("message content that is neither text nor parts")


def chat_usage(usage: Any) -> dict[str, Any]:
    """OpenAI usage from Anthropic's (whose input_tokens leave out the cache reads and writes)."""
    usage = usage if isinstance(usage, dict) else {}
    cached = _int(usage.get("cache_read_input_tokens"))
    prompt = _int(usage.get("input_tokens")) + cached + _int(usage.get("cache_creation_input_tokens"))
    completion = _int(usage.get("output_tokens"))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _finish(reason: Any, sequence: Any) -> dict[str, Any]:
    """The choice fields that say why the output ended (`stop_reason` names a stop string, as vLLM does)."""
    fields: dict[str, Any] = {"finish_reason": FINISH_REASONS.get(reason, "stop") if reason else None}
    if reason == "stop_sequence" and isinstance(sequence, str):
        fields["stop_reason"] = sequence
    return fields


def to_chat_completion(message: Any) -> dict[str, Any]:
    """A whole Anthropic message as an OpenAI chat completion."""
    if not isinstance(message, dict):
        raise ValueError("not a message object")
    blocks = message.get("content") or []
    text = "".join(b["text"] for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str))
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              **_finish(message.get("stop_reason"), message.get("stop_sequence"))}
    return {"id": f"chatcmpl-{message.get('id', '')}", "object": "chat.completion", "created": int(time.time()),
            "model": message.get("model", ""), "choices": [choice], "usage": chat_usage(message.get("usage"))}


def openai_error(body: bytes) -> bytes:
    """An upstream's Anthropic-style error body as an OpenAI-style one (the Anthropic error type is the code)."""
    try:
        error = orjson.loads(body)["error"]
        message, kind = str(error.get("message", "")), str(error.get("type", "api_error"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        message, kind = body[:500].decode(errors="replace"), "api_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": kind}})


class ChatChunks:
    """Anthropic stream events in, OpenAI chat chunks out: the role first (message_start), a content chunk
    per text delta, the finish reason at message_delta, the usage chunk when the client asked for it,
    then [DONE]. An `error` event becomes an OpenAI error event and ends the stream."""

    __slots__ = ("_created", "_ended", "_framer", "_id", "_include_usage", "_model", "_usage")

    def __init__(self, include_usage: bool) -> None:
        self._include_usage = include_usage   # stream_options.include_usage of the client's request
        self._framer = SseFramer()
        self._id = "chatcmpl-"
        self._model = ""
        self._created = int(time.time())
        self._usage: dict[str, Any] = {}      # Anthropic usage so far (message_start, then message_delta)
        self._ended = False                   # [DONE] or an error went out

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def usage(self) -> dict[str, Any] | None:
        """The answer's usage in OpenAI's form, once the upstream reported it (at message_delta)."""
        return chat_usage(self._usage) if "output_tokens" in self._usage else None

    def feed(self, chunk: bytes) -> bytes:
        out = b""
        for event in self._framer.feed(chunk):
            if not self._ended:
                out += self._translate(event)
        return out

    def _translate(self, event: SseEvent) -> bytes:
        if not event.data:
            return b""
        try:
            payload = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            return b""
        kind = payload.get("type") if isinstance(payload, dict) else None
        if kind == "message_start":
            message = payload.get("message") or {}
            self._id, self._model = f"chatcmpl-{message.get('id', '')}", str(message.get("model", ""))
            self._usage.update(message.get("usage") or {})
            return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                return self._chunk({"delta": {"content": delta["text"]}, "finish_reason": None})
            return b""
        if kind == "message_delta":
            self._usage.update({k: v for k, v in (payload.get("usage") or {}).items() if v is not None})
            delta = payload.get("delta") or {}
            return self._chunk({"delta": {}, **_finish(delta.get("stop_reason"), delta.get("stop_sequence"))})
        if kind == "message_stop":
            self._ended = True
            usage = data_event(self._envelope([]) | {"usage": chat_usage(self._usage)}) if self._include_usage else b""
            return usage + DONE_EVENT
        if kind == "error":
            self._ended = True
            error = payload.get("error") or {}
            kind = str(error.get("type", "api_error"))
            return data_event({"error": {"message": str(error.get("message", "")), "type": kind, "param": None,
                                         "code": kind}}) + DONE_EVENT
        return b""   # ping, content_block_start/stop, and event types added later

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return data_event(self._envelope([{"index": 0, **choice}]))

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
                "choices": choices}
