"""OpenAI chat chunks in, another API's stream out: the frame of the gateway's inbound stream translators
(Anthropic's Messages events, the Responses API's events). This class frames the bytes (cut anywhere), keeps
the usage, the finishing choice and the count of pieces, numbers the tool calls, and sends nothing after the
end; a subclass says what goes out first, for each piece of text, when a tool call starts and for each piece
of its arguments, at the end, for an error event and for a keepalive.

Pure: no I/O.
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.translate.sse import SseEvent, SseFramer


class ChatStreamTranslator:
    __slots__ = ("_calls", "_ended", "_finish", "_framer", "_num_deltas", "_started", "_usage")

    def __init__(self) -> None:
        self._framer = SseFramer()
        self._started = False                       # the opening events went out
        self._ended = False                         # the closing or an error went out: nothing more follows
        self._finish: Mapping[str, Any] = {}        # the choice that carried the finish_reason
        self._usage: Any = None                     # the upstream's usage object, when it sends one
        self._num_deltas = 0                        # pieces relayed (output tokens when no usage comes)
        self._calls: dict[Any, int] = {}            # the upstream's tool call index -> ours (0, 1, ... as they start)

    def feed(self, chunk: bytes) -> bytes:
        out = b""
        for event in self._framer.feed(chunk):
            if not self._ended:
                out += self._translate(event)
        return out

    def close(self) -> bytes:
        """The end of the upstream's stream: a started answer that did not end is ended now."""
        if self._ended or not self._started:
            return b""
        return self._end()

    # --- what a subclass sends ---

    def _opening(self) -> bytes:
        raise NotImplementedError

    def _text(self, text: str) -> bytes:
        raise NotImplementedError

    def _tool_call(self, number: int, call_id: str, name: str) -> bytes:
        """Tool call `number` (0, 1, ... in the order they start) starts."""
        raise NotImplementedError

    def _tool_arguments(self, number: int, piece: str) -> bytes:
        """A piece of tool call `number`'s arguments (a JSON text, whole once every piece came)."""
        raise NotImplementedError

    def _closing(self) -> bytes:
        raise NotImplementedError

    def _failure(self, error: Mapping[str, Any]) -> bytes:
        raise NotImplementedError

    def _keepalive(self) -> bytes:
        raise NotImplementedError

    # ---

    def _translate(self, event: SseEvent) -> bytes:
        if event.data is None:
            return self._keepalive()
        if event.data == b"[DONE]":
            return self._start() + self._end()
        try:
            payload = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            return b""
        if not isinstance(payload, dict):
            return b""
        if isinstance(payload.get("error"), dict) and not payload.get("choices"):
            self._ended = True
            return self._failure(payload["error"])
        out = self._start()
        if isinstance(payload.get("usage"), dict):
            self._usage = payload["usage"]
        choices = payload.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                self._num_deltas += 1
                out += self._text(text)
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    if isinstance(call, dict):
                        out += self._tool_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice
        return out

    def _tool_delta(self, call: Mapping[str, Any]) -> bytes:
        """One entry of a chunk's `delta.tool_calls`: the first for its `index` carries the call's id and name,
        and any of them a piece of its arguments."""
        out = b""
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        key = call.get("index", 0)
        key = key if isinstance(key, int) else str(key)
        number = self._calls.get(key)
        if number is None:
            number = self._calls[key] = len(self._calls)
            call_id, name = call.get("id"), function.get("name")
            out += self._tool_call(number, call_id if isinstance(call_id, str) and call_id else
                                   f"call_{uuid.uuid4().hex[:24]}", name if isinstance(name, str) else "")
        piece = function.get("arguments")
        if isinstance(piece, str) and piece:
            self._num_deltas += 1
            out += self._tool_arguments(number, piece)
        return out

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self._opening()

    def _end(self) -> bytes:
        self._ended = True
        return self._closing()
