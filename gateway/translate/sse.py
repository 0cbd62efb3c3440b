"""Server-sent events as every stream translator sees them (Anthropic's Messages events both ways, the
Responses API's events): bytes cut anywhere in, whole events out; and one event encoded in the named form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class SseEvent:
    name: str | None          # the `event:` field (None: unnamed, as OpenAI streams send them)
    data: bytes | None        # the `data:` lines joined by "\n"; None: a comment-only event (a keepalive)


class SseFramer:
    """Splits a byte stream into events; a partial event waits for the bytes that complete it."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        data = self._tail + chunk if self._tail else chunk
        if b"\r" in data:  # CRLF upstreams; a lone trailing CR stays in the tail until its LF arrives
            data = data.replace(b"\r\n", b"\n")
        *raw_events, self._tail = data.split(b"\n\n")
        return [event for raw in raw_events if (event := parse_event(raw)) is not None]


def parse_event(raw: bytes) -> SseEvent | None:
    """One event's lines; None for an empty one."""
    name: str | None = None
    lines: list[bytes] = []
    has_comment = False
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            lines.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode(errors="replace")
        elif line.startswith(b":"):
            has_comment = True
    if lines:
        return SseEvent(name, b"\n".join(lines))
    if name is not None:
        return SseEvent(name, b"")
    return SseEvent(None, None) if has_comment else None


def named_event(payload: dict[str, Any]) -> bytes:
    """An Anthropic event: its `type` is also the SSE event name."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def data_event(payload: dict[str, Any]) -> bytes:
    """An OpenAI stream event (unnamed)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"
