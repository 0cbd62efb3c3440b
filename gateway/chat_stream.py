"""OpenAI chat chunks in, another API's stream out: the frame of the gateway's inbound stream translators
(Anthropic's Messages events, the Responses API's events). This class frames the bytes (cut anywhere), keeps
the usage, the finishing choice and the count of text pieces, and sends nothing after the end; a subclass
says what goes out first, for each piece of text, at the end, for an error event and for a keepalive.

Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.anthropic.sse import SseEvent, SseFramer


class ChatStreamTranslator:
    __slots__ = ("_ended", "_finish", "_framer", "_num_deltas", "_started", "_usage")

    def __init__(self) -> None:
        self._framer = SseFramer()
        self._started = False                       # the opening events went out
        self._ended = False                         # the closing or an error went out: nothing more follows
        self._finish: Mapping[str, Any] = {}        # the choice that carried the finish_reason
        self._usage: Any = None                     # the upstream's usage object, when it sends one
        self._num_deltas = 0                        # text pieces relayed (output tokens when no usage comes)

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
            text = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(text, str) and text:
                self._num_deltas += 1
                out += self._text(text)
            if choice.get("finish_reason") is not None:
                self._finish = choice
        return out

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self._opening()

    def _end(self) -> bytes:
        self._ended = True
        return self._closing()
