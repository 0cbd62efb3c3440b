"""OpenAI chat requests to an Anthropic-compatible upstream (the `anthropic` provider kind): the chat
body becomes a Messages request, and the upstream's message (whole or streamed) and errors come back as
OpenAI chat completions, chunks and errors. Tool use goes both ways: function tools, `tool_choice` and
a conversation's tool calls and results become Anthropic's tools and tool_use/tool_result blocks, and
tool_use blocks come back as `tool_calls`.

Pure: no I/O. A body that has no Anthropic form raises `Untranslatable` (the provider hands the request on).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.server.client_stream import DONE_EVENT
from gateway.translate.sse import SseEvent, SseFramer, data_event

# Anthropic requires max_tokens; a chat request without one gets this many.
DEFAULT_MAX_TOKENS = 4096
# Anthropic stop_reason -> OpenAI finish_reason.
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                  "refusal": "content_filter", "pause_turn": "stop"}
SYSTEM_ROLES = frozenset({"system", "developer"})
# OpenAI's tool_choice strings -> the type of Anthropic's tool_choice object.
TOOL_CHOICES = {"auto": "auto", "required": "any", "none": "none"}


class Untranslatable(Exception):
    """The chat request uses something the Messages API form here does not carry (legacy `functions`, tools
    other than functions, tool call arguments that are not a JSON object, images, n > 1, a JSON response_format,
    logprobs)."""


def to_messages_request(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI chat completions body as an Anthropic Messages request for `model`."""
    if body.get("n", 1) != 1:
        raise Untranslatable("n > 1")
    if body.get("functions"):
        raise Untranslatable("functions (the legacy form of tools)")
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type", "text") != "text":
        raise Untranslatable("a JSON response_format")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise Untranslatable("logprobs (the Messages API has none)")
    system, messages = _messages(body["messages"])
    request: dict[str, Any] = {
        "model": model, "messages": messages,
        "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS}
    if system:
        request["system"] = "\n".join(system)
    if body.get("tools"):
        request.update(_tool_fields(body))
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


def _messages(chat: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The system texts, and the turns as Anthropic takes them: `tool` messages as tool_result blocks of a
    user turn, and a turn with blocks merged into a neighbour of its role (Anthropic wants the roles to
    alternate, and every result of one assistant turn in the one user turn after it)."""
    system: list[str] = []
    messages: list[dict[str, Any]] = []
    for message in chat:
        role = message.get("role")
        content: str | list[dict[str, Any]]
        if role in SYSTEM_ROLES:
            system.append(_text(message.get("content")))
            continue
        if role == "tool":
            role, content = "user", [_tool_result(message)]
        elif role == "assistant" and message.get("tool_calls"):
            content = _tool_uses(message)
        elif role in ("user", "assistant"):
            if message.get("function_call"):
                raise Untranslatable("function_call (the legacy form of tool_calls)")
            content = _text(message.get("content"))
        else:
            raise Untranslatable(f"messages with role {role!r}")
        last = messages[-1] if messages else None
        has_blocks = last is not None and (isinstance(content, list) or isinstance(last["content"], list))
        if last is not None and last["role"] == role and has_blocks:
            last["content"] = _blocks(last["content"]) + _blocks(content)
        else:
            messages.append({"role": role, "content": content})
    return system, messages


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []   # Anthropic refuses empty text blocks


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


def _tool_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """`tools` and `tool_choice` in Anthropic's form; `parallel_tool_calls: false` rides in tool_choice."""
    tools = body["tools"]
    if not isinstance(tools, list):
        raise Untranslatable("tools that are not a list")
    fields: dict[str, Any] = {"tools": [_tool(tool) for tool in tools]}
    choice = _tool_choice(body.get("tool_choice"))
    # Anthropic's {"type": "none"} has no disable_parallel_tool_use (no calls at all is fewer than one).
    if body.get("parallel_tool_calls") is False and (choice is None or choice["type"] != "none"):
        choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
    if choice is not None:
        fields["tool_choice"] = choice
    return fields


def _tool(tool: Any) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Untranslatable("tools other than named functions")
    schema = function.get("parameters") or {"type": "object", "properties": {}}   # Anthropic requires a schema
    if not isinstance(schema, dict):
        raise Untranslatable("function parameters that are not a JSON schema")
    out: dict[str, Any] = {"name": function["name"]}
    if isinstance(function.get("description"), str):
        out["description"] = function["description"]
    return out | {"input_schema": schema}


def _tool_choice(choice: Any) -> dict[str, Any] | None:
    if choice is None:
        return None
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return {"type": TOOL_CHOICES[choice]}
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return {"type": "tool", "name": function["name"]}
    raise Untranslatable(f"tool_choice {choice!r}")


def _tool_uses(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An assistant turn with tool calls: its text (if any), then a tool_use block per call."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise Untranslatable("tool_calls that are not a list")
    blocks = _blocks(_text(message.get("content")))
    for call in calls:
        call = call if isinstance(call, dict) else {}
        function = call.get("function") if call.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(call.get("id"), str):
            raise Untranslatable("tool calls other than functions with an id and a name")
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                       "input": _arguments(function.get("arguments"))})
    return blocks


def _arguments(arguments: Any) -> dict[str, Any]:
    """A call's arguments (JSON text) as tool_use `input`, which must be an object; "" is a call without any."""
    if arguments is None or arguments == "":
        return {}
    try:
        value = orjson.loads(arguments) if isinstance(arguments, str) else None
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):   # sent on, it would be a call the model never made
        raise Untranslatable("tool call arguments that are not a JSON object")
    return value


def _tool_result(message: Mapping[str, Any]) -> dict[str, Any]:
    """A `tool` message as a tool_result block (its content is optional in Anthropic's form, and left out empty)."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise Untranslatable("a tool message without tool_call_id")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    text = _text(message.get("content"))
    if text:
        block["content"] = text
    return block


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
    fields: dict[str, Any] = {"finish_reason": _finish_reason(reason)}
    if reason == "stop_sequence" and isinstance(sequence, str):
        fields["stop_reason"] = sequence
    return fields


def _finish_reason(reason: Any) -> str | None:
    if not reason:
        return None
    return FINISH_REASONS.get(reason, "stop") if isinstance(reason, str) else "stop"


def to_chat_completion(message: Any) -> dict[str, Any]:
    """A whole Anthropic message as an OpenAI chat completion."""
    if not isinstance(message, dict):
        raise ValueError("not a message object")
    blocks = [b for b in message.get("content") or [] if isinstance(b, dict)]
    text = "".join(b["text"] for b in blocks if isinstance(b.get("text"), str))
    calls = [_tool_call(b) for b in blocks if b.get("type") == "tool_use"]
    reply: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        reply["tool_calls"] = calls
    choice = {"index": 0, "message": reply, **_finish(message.get("stop_reason"), message.get("stop_sequence"))}
    return {"id": f"chatcmpl-{message.get('id', '')}", "object": "chat.completion", "created": int(time.time()),
            "model": message.get("model", ""), "choices": [choice], "usage": chat_usage(message.get("usage"))}


def _tool_call(block: Mapping[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """A tool_use block as an OpenAI tool call; its arguments are the input as compact JSON unless given."""
    if arguments is None:
        arguments = orjson.dumps(block.get("input") or {}).decode()
    return {"id": str(block.get("id", "")), "type": "function",
            "function": {"name": str(block.get("name", "")), "arguments": arguments}}


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
    per text delta, a tool call's id and name when its tool_use block starts and its arguments as their
    input_json_delta pieces arrive, the finish reason at message_delta, the usage chunk when the client
    asked for it, then [DONE]. An `error` event becomes an OpenAI error event and ends the stream."""

    __slots__ = ("_created", "_ended", "_framer", "_id", "_include_usage", "_model", "_tool_calls", "_usage")

    def __init__(self, include_usage: bool) -> None:
        self._include_usage = include_usage   # stream_options.include_usage of the client's request
        self._framer = SseFramer()
        self._id = "chatcmpl-"
        self._model = ""
        self._created = int(time.time())
        self._usage: dict[str, Any] = {}      # Anthropic usage so far (message_start, then message_delta)
        self._ended = False                   # [DONE] or an error went out
        self._tool_calls: dict[int, int] = {}  # Anthropic block index -> OpenAI tool call index (0, 1, ...)

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
        if kind == "content_block_start":
            block = payload.get("content_block") or {}
            if block.get("type") != "tool_use":
                return b""
            index = self._tool_calls.setdefault(payload.get("index"), len(self._tool_calls))
            call = {"index": index, **_tool_call(block, arguments="")}   # the input comes in the deltas that follow
            return self._chunk({"delta": {"tool_calls": [call]}, "finish_reason": None})
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                return self._chunk({"delta": {"content": delta["text"]}, "finish_reason": None})
            call_index = self._tool_calls.get(payload.get("index"))
            if delta.get("type") == "input_json_delta" and delta.get("partial_json") and call_index is not None:
                pieces = [{"index": call_index, "function": {"arguments": delta["partial_json"]}}]
                return self._chunk({"delta": {"tool_calls": pieces}, "finish_reason": None})
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
        return b""   # ping, content_block_stop, and event types added later

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return data_event(self._envelope([{"index": 0, **choice}]))

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self._id, "object": "chat.completion.chunk", "created": self._created, "model": self._model,
                "choices": choices}
