"""A forced tool call's answer text, read as OpenAI `tool_calls` while it is generated (backends/server/tools.py
says what the text is): the named function's arguments, or the array "required" answers with. Each piece of
text yields the stream deltas it completes: a call's id, type and name first, then its arguments as they come.
The whole answer's calls are what the deltas add up to. The schema the text was decoded under fixes its shape
(`{"name": ..., "arguments": {...}}`, in that order, with whitespace between tokens); text of another shape
ends the reading.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from backends.server.tools import ToolCalling

_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')   # a call up to its arguments
_SPACE = " \t\n\r"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallText:
    """The calls in one sequence's forced tool-call text, fed piece by piece."""

    def __init__(self, tools: ToolCalling) -> None:
        self.calls: list[ToolCall] = []
        self._forced = tools.forced
        self._text = ""
        self._at = 0              # how far the text is read
        self._state = "between"   # between calls, in a call's "head", its "arguments", "after" them; or "done"
        self._depth = 0           # in the arguments: containers open
        self._in_string = False
        self._escaped = False

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The `tool_calls` stream deltas `piece` completes, in order."""
        if self._forced is not None:     # the text is the named function's arguments, whole
            if not piece:
                return []
            if not self.calls:
                self.calls.append(ToolCall(_new_id(), self._forced, piece))
                return [{"index": 0, **self.calls[0].body()}]
            self.calls[0].arguments += piece
            return [{"index": 0, "function": {"arguments": piece}}]
        self._text += piece
        deltas: list[dict[str, Any]] = []
        while self._at < len(self._text) and self._state != "done":
            if self._state == "head":
                if not self._read_head(deltas):
                    break
            elif self._state == "arguments":
                self._read_arguments(deltas)
            else:
                self._read_between()
        return deltas

    def _read_between(self) -> None:
        """Outside a call: the array's brackets and commas, whitespace, the '}' that closes a call; a '{' opens
        the next call."""
        char = self._text[self._at]
        if char == "{" and self._state == "between":
            self._state = "head"
            return
        self._at += 1
        if char == "}" and self._state == "after":
            self._state = "between"
        elif char == "]" and self._state == "between":
            self._state = "done"
        elif char not in _SPACE and not (char in "[," and self._state == "between"):
            self._state = "done"       # not the schema's shape: read no further

    def _read_head(self, deltas: list[dict[str, Any]]) -> bool:
        """A call's id and name, once its head is whole and its arguments have begun. False: wait for more."""
        match = _HEAD.match(self._text, self._at)
        if match is None or match.end() == len(self._text):     # (greedy spaces: a character follows them)
            return False
        self.calls.append(ToolCall(_new_id(), json.loads(match.group(1))))
        deltas.append({"index": len(self.calls) - 1, **self.calls[-1].body()})
        self._at, self._state = match.end(), "arguments"
        return True

    def _read_arguments(self, deltas: list[dict[str, Any]]) -> None:
        """The arguments (a JSON object) up to the end of the text or of the object, whichever comes first."""
        text, start = self._text, self._at
        at, depth, in_string, escaped = start, self._depth, self._in_string, self._escaped
        while at < len(text):
            char = text[at]
            at += 1
            if in_string:
                escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    self._state = "after"
                    break
        self._at, self._depth, self._in_string, self._escaped = at, depth, in_string, escaped
        index = len(self.calls) - 1
        self.calls[index].arguments += text[start:at]
        deltas.append({"index": index, "function": {"arguments": text[start:at]}})


def _new_id() -> str:
    return "call_" + secrets.token_hex(12)
