"""OpenAI's Responses API over the chat dispatch: a `POST /v1/responses` request becomes a chat completions
body, and the chat answer (whole or streamed) comes back as a Response object or as the Responses stream's
semantic events. Text, function tools (gateway/translate/responses_tools.py) and structured output (`text.format`
as the chat `response_format`); stored responses (`previous_response_id`, `conversation`, `background`) and
other tools are refused with a 400 rather than ignored.

Pure: no I/O. Bad requests raise `BadRequest` (rendered in OpenAI's error shape).
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest
from gateway.translate.chat_stream import ChatStreamTranslator
from gateway.translate.responses_tools import (
    chat_tool_call,
    chat_tools,
    function_call_item,
    function_call_items,
    joined_text,
    tool_message,
)
from gateway.translate.sse import named_event

ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text"})
# Items of the model's own reasoning, sent back with the conversation (Codex does): no chat template takes them.
SKIPPED_ITEMS = frozenset({"reasoning"})
REFUSED = {"previous_response_id": "responses are not stored: send the whole conversation as `input`",
           "conversation": "conversations are not stored: send the whole conversation as `input`",
           "background": "background responses are not supported"}


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every answer to one Responses request carries besides the upstream's text."""
    response_id: str                      # "resp_..." (the gateway makes one per request)
    message_id: str                       # "msg_...": the first message output item's id
    created_at: int                       # unix seconds
    request: Mapping[str, Any]            # the client's body (echoed fields: model, instructions, metadata...)


# --- the request -------------------------------------------------------------------------------------

def to_chat_body(body: Any) -> dict[str, Any]:
    """A validated Responses request as an OpenAI chat completions body (usage asked for when streaming)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    for name, why in REFUSED.items():
        if body.get(name):
            raise BadRequest(f"'{name}': {why}", param=name)
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    chat: dict[str, Any] = {"model": model, "messages": messages, **chat_tools(body), **_response_format(body)}
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None:
        if not isinstance(max_output_tokens, int) or isinstance(max_output_tokens, bool) or max_output_tokens < 1:
            raise BadRequest("'max_output_tokens' must be an integer of at least 1", param="max_output_tokens")
        chat["max_tokens"] = max_output_tokens     # check_body caps it
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if stream:
        chat.update(stream=True, stream_options={"include_usage": True})
    return chat


def _response_format(body: Mapping[str, Any]) -> dict[str, Any]:
    """`text.format` as the chat body's `response_format`: none for plain text; a JSON object (which switchyard
    workers constrain their output to) or a JSON schema (which goes to a provider that follows schemas)."""
    text = body.get("text")
    if text is None:
        return {}
    text_format = text.get("format") if isinstance(text, dict) else None
    if text_format is None:
        return {}
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        assert isinstance(text_format, dict)
        name, schema = text_format.get("name"), text_format.get("schema")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise BadRequest("'text.format': a json_schema format has a non-empty `name` and a `schema` object",
                             param="text.format")
        json_schema = {"name": name, "schema": schema,
                       **{k: text_format[k] for k in ("description", "strict") if text_format.get(k) is not None}}
        return {"response_format": {"type": "json_schema", "json_schema": json_schema}}
    raise BadRequest("'text.format' must be an object whose type is 'text', 'json_object' or 'json_schema'",
                     param="text.format")


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """The input's items as chat messages: consecutive function_call items, with the assistant message item
    right before them, become one assistant message with `tool_calls`; a function_call_output, a tool message."""
    if isinstance(value, str):
        if not value:
            raise BadRequest("'input' must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' is required: a string or a non-empty array of messages", param="input")
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise BadRequest(f"'{where}.role' must be one of {sorted(ROLES)}", param=f"{where}.role")
            out.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = chat_tool_call(item, where)
            call_ids.add(call["id"])
            if out and out[-1]["role"] == "assistant":
                last = out[-1]
                last["content"] = last["content"] or None
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(tool_message(item, where, call_ids))
        elif not isinstance(kind, str) or kind not in SKIPPED_ITEMS:
            raise BadRequest(f"'{where}': only message, function_call and function_call_output items are "
                             f"supported, not {kind!r}", param=where)
    if not out:
        raise BadRequest("'input' has no message or function call items", param="input")
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise BadRequest(f"'{where}' must be a string or a non-empty array of text parts", param=where)
    return joined_text(content, TEXT_PARTS, "text", where)


# --- the answer --------------------------------------------------------------------------------------

def usage(openai_usage: Any, num_output_tokens: int) -> dict[str, Any] | None:
    """The Responses usage of an OpenAI usage object (input_tokens includes the cached ones, as OpenAI
    counts); None when the upstream sent none."""
    if not isinstance(openai_usage, dict):
        return None
    prompt, completion = openai_usage.get("prompt_tokens"), openai_usage.get("completion_tokens")
    num_input = prompt if isinstance(prompt, int) else 0
    num_output = completion if isinstance(completion, int) else num_output_tokens
    details = openai_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    num_cached = cached if isinstance(cached, int) else 0
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + num_output}


def response_object(header: ResponseHeader, output: list[dict[str, Any]] | None, finish_reason: str | None,
                    openai_usage: Any = None, num_output_tokens: int = 0) -> dict[str, Any]:
    """The Response: in progress (`output` None), or completed (incomplete when max_output_tokens ended it).
    The request's tools, tool_choice and parallel_tool_calls are echoed as the client sent them."""
    request = header.request
    status = "in_progress" if output is None else "incomplete" if finish_reason == "length" else "completed"
    choice, parallel = request.get("tool_choice"), request.get("parallel_tool_calls")
    return {
        "id": header.response_id, "object": "response", "created_at": header.created_at, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model"), "output": output or [],
        "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "tool_choice": "auto" if choice is None else choice, "tools": request.get("tools") or [],
        "text": {"format": _text_format(request)}, "metadata": request.get("metadata") or {},
        "store": False, "usage": usage(openai_usage, num_output_tokens) if output is not None else None,
    }


def _text_format(request: Mapping[str, Any]) -> Any:
    text = request.get("text")
    text_format = text.get("format") if isinstance(text, dict) else None
    return text_format if isinstance(text_format, dict) else {"type": "text"}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def to_response(completion: Any, header: ResponseHeader) -> dict[str, Any]:
    """A whole OpenAI chat completion as a Response: a message item (unless the answer is tool calls alone),
    then a function_call item per tool call; the last one is incomplete when max_output_tokens ended it."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    text = message.get("content")
    text = text if isinstance(text, str) else ""
    calls = function_call_items(message)
    output = ([_message_item(header.message_id, text, "completed")] if text or not calls else []) + calls
    finish_reason = choice.get("finish_reason")
    if finish_reason == "length":
        output[-1]["status"] = "incomplete"
    return response_object(header, output, finish_reason,
                           completion.get("usage") if isinstance(completion, dict) else None)


# --- the stream --------------------------------------------------------------------------------------

class ResponseEvents(ChatStreamTranslator):
    """OpenAI chat chunks in, the Responses stream's events out: response.created and response.in_progress
    first; output items open as the answer reaches them (a message item at the first text, and again at text
    after a tool call; a function_call item per tool call), each at the next output_index with
    output_item.added (and content_part.added), its deltas (output_text.delta, function_call_arguments.delta),
    and its done events when the next item opens or the stream ends; then response.completed
    (response.incomplete when max_output_tokens ended it) listing every item. An answer with no items gets
    one empty message item. Every event carries its sequence_number. A keepalive stays a comment; an error
    event becomes response.failed and ends the stream."""

    __slots__ = ("_call_items", "_header", "_items", "_open", "_pieces", "_sequence")

    def __init__(self, header: ResponseHeader) -> None:
        super().__init__()
        self._header = header
        self._sequence = 0
        self._items: list[dict[str, Any]] = []         # output items in order, each as it went out last
        self._pieces: list[list[str]] = []             # per item: its text's or its arguments' pieces
        self._open: int | None = None                  # the output_index of the item not yet done
        self._call_items: dict[int, int] = {}          # a tool call's number -> its output_index

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return named_event({"type": kind, "sequence_number": self._sequence - 1, **fields})

    def _keepalive(self) -> bytes:
        return b": keepalive\n\n"

    def _opening(self) -> bytes:
        created = response_object(self._header, None, None)
        return self._event("response.created", response=created) + self._event("response.in_progress",
                                                                               response=created)

    def _text(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._items[self._open]["type"] != "message":
            out += self._open_message()
        index = self._open
        assert index is not None
        self._pieces[index].append(text)
        return out + self._event("response.output_text.delta", item_id=self._items[index]["id"], output_index=index,
                                 content_index=0, delta=text, logprobs=[])

    def _tool_call(self, number: int, call_id: str, name: str) -> bytes:
        out = self._close_item("completed")
        index = self._call_items[number] = self._add(function_call_item(call_id, name, "", "in_progress"))
        return out + self._event("response.output_item.added", output_index=index, item=self._items[index])

    def _tool_arguments(self, number: int, piece: str) -> bytes:
        index = self._call_items[number]
        item = self._items[index]
        self._pieces[index].append(piece)
        if index != self._open:     # a piece for a call already done (an upstream interleaving calls)
            self._items[index] = {**item, "arguments": item["arguments"] + piece}
        return self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=piece)

    def _closing(self) -> bytes:
        finish_reason = self._finish.get("finish_reason")
        out = b"" if self._items else self._open_message()
        out += self._close_item("incomplete" if finish_reason == "length" else "completed")
        final = response_object(self._header, list(self._items), finish_reason, self._usage, self._num_deltas)
        return out + self._event(f"response.{final['status']}", response=final)

    def _failure(self, error: Mapping[str, Any]) -> bytes:
        out = self._start()
        failed = {**response_object(self._header, None, None), "status": "failed",
                  "error": {"code": str(error.get("code") or "server_error"),
                            "message": str(error.get("message") or "upstream error")}}
        return out + self._event("response.failed", response=failed)

    # ---

    def _add(self, item: dict[str, Any]) -> int:
        """A new output item, open, at the next output_index."""
        self._items.append(item)
        self._pieces.append([])
        self._open = len(self._items) - 1
        return self._open

    def _open_message(self) -> bytes:
        out = self._close_item("completed")
        first = not any(item["type"] == "message" for item in self._items)
        item_id = self._header.message_id if first else f"msg_{uuid.uuid4().hex}"
        index = self._add(_message_item(item_id, None, "in_progress"))
        return (out + self._event("response.output_item.added", output_index=index, item=self._items[index])
                + self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                              part=_text_part("")))

    def _close_item(self, status: str) -> bytes:
        """The open item's done events (none when no item is open)."""
        index, self._open = self._open, None
        if index is None:
            return b""
        item, whole = self._items[index], "".join(self._pieces[index])
        if item["type"] == "message":
            done = {**item, "status": status, "content": [_text_part(whole)]}
            out = (self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=whole, logprobs=[])
                   + self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=_text_part(whole)))
        else:
            done = {**item, "arguments": whole, "status": status}
            out = self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=whole)
        self._items[index] = done
        return out + self._event("response.output_item.done", output_index=index, item=done)
