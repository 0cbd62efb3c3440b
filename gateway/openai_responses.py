"""OpenAI's Responses API over the chat dispatch: a `POST /v1/responses` request becomes a chat completions
body, and the chat answer (whole or streamed) comes back as a Response object or as the Responses stream's
semantic events. Text in, text out: tools, stored responses (`previous_response_id`, `conversation`,
`background`) and structured output are refused with a 400 rather than ignored.

Pure: no I/O. Bad requests raise `BadRequest` (rendered in OpenAI's error shape).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.anthropic.sse import named_event
from gateway.chat_stream import ChatStreamTranslator
from gateway.errors import BadRequest

ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text"})
REFUSED = {"tools": "tool use is not supported by this gateway",
           "previous_response_id": "responses are not stored: send the whole conversation as `input`",
           "conversation": "conversations are not stored: send the whole conversation as `input`",
           "background": "background responses are not supported"}


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every answer to one Responses request carries besides the upstream's text."""
    response_id: str                      # "resp_..." (the gateway makes one per request)
    message_id: str                       # "msg_...": the one output item's id
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
    text_format = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(text_format, dict) and text_format.get("type", "text") != "text":
        raise BadRequest("'text.format': only plain text is supported (no structured output)", param="text.format")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"))
    chat: dict[str, Any] = {"model": model, "messages": messages}
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


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise BadRequest("'input' must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' is required: a string or a non-empty array of messages", param="input")
    out = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise BadRequest(f"'{where}': only message items are supported, not {kind!r}", param=where)
        if item.get("role") not in ROLES:
            raise BadRequest(f"'{where}.role' must be one of {sorted(ROLES)}", param=f"{where}.role")
        out.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise BadRequest(f"'{where}' must be a string or a non-empty array of text parts", param=where)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"'{where}[{index}]': only text parts are supported, not {kind!r}",
                             param=f"{where}[{index}]")
        texts.append(part["text"])
    return "\n".join(texts)


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


def response_object(header: ResponseHeader, text: str | None, finish_reason: str | None,
                    openai_usage: Any = None, num_output_tokens: int = 0) -> dict[str, Any]:
    """The Response: in progress (`text` None), or completed (incomplete when max_output_tokens ended it)."""
    request = header.request
    if text is None:
        status, output = "in_progress", []
    else:
        status = "incomplete" if finish_reason == "length" else "completed"
        output = [_message_item(header, text, status)]
    return {
        "id": header.response_id, "object": "response", "created_at": header.created_at, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model"), "output": output, "parallel_tool_calls": True,
        "temperature": request.get("temperature"), "top_p": request.get("top_p"), "tool_choice": "auto",
        "tools": [], "text": {"format": {"type": "text"}}, "metadata": request.get("metadata") or {},
        "store": False, "usage": usage(openai_usage, num_output_tokens) if text is not None else None,
    }


def _message_item(header: ResponseHeader, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": header.message_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def to_response(completion: Any, header: ResponseHeader) -> dict[str, Any]:
    """A whole OpenAI chat completion as a Response."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else None
    return response_object(header, text if isinstance(text, str) else "", choice.get("finish_reason"),
                           completion.get("usage") if isinstance(completion, dict) else None)


# --- the stream --------------------------------------------------------------------------------------

class ResponseEvents(ChatStreamTranslator):
    """OpenAI chat chunks in, the Responses stream's events out: response.created, response.in_progress,
    output_item.added and content_part.added before the first text, an output_text.delta per chunk of text,
    then output_text.done, content_part.done, output_item.done and response.completed (response.incomplete
    when max_output_tokens ended it) at [DONE]. Every event carries its sequence_number. A keepalive stays a
    comment; an error event becomes response.failed and ends the stream."""

    __slots__ = ("_header", "_sequence", "_texts")

    def __init__(self, header: ResponseHeader) -> None:
        super().__init__()
        self._header = header
        self._sequence = 0
        self._texts: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return named_event({"type": kind, "sequence_number": self._sequence - 1, **fields})

    def _keepalive(self) -> bytes:
        return b": keepalive\n\n"

    def _text(self, text: str) -> bytes:
        self._texts.append(text)
        return self._event("response.output_text.delta", item_id=self._header.message_id, output_index=0,
                           content_index=0, delta=text, logprobs=[])

    def _opening(self) -> bytes:
        header = self._header
        created = response_object(header, None, None)
        return (self._event("response.created", response=created)
                + self._event("response.in_progress", response=created)
                + self._event("response.output_item.added", output_index=0,
                              item=_message_item(header, None, "in_progress"))
                + self._event("response.content_part.added", item_id=header.message_id, output_index=0,
                              content_index=0, part=_text_part("")))

    def _closing(self) -> bytes:
        header, text = self._header, "".join(self._texts)
        final = response_object(header, text, self._finish.get("finish_reason"), self._usage, self._num_deltas)
        return (self._event("response.output_text.done", item_id=header.message_id, output_index=0,
                            content_index=0, text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=header.message_id, output_index=0,
                              content_index=0, part=_text_part(text))
                + self._event("response.output_item.done", output_index=0, item=final["output"][0])
                + self._event(f"response.{final['status']}", response=final))

    def _failure(self, error: Mapping[str, Any]) -> bytes:
        out = self._start()
        failed = {**response_object(self._header, None, None), "status": "failed",
                  "error": {"code": str(error.get("code") or "server_error"),
                            "message": str(error.get("message") or "upstream error")}}
        return out + self._event("response.failed", response=failed)
