"""Mid-stream failover (docs/reliability.md): when an upstream dies after the client has part of a streamed
answer, the answer goes on elsewhere as a continuation, and the client sees one stream.

- `Transcript` keeps the events relayed to the client (and holds back a partial event, so the client never
  has half of one when the stream breaks).
- `answered_so_far` reads a broken stream's transcript into what the client has (`SoFar`).
- `leg_body` builds an upstream body: for a continuation, the prompt plus the output so far. Our workers
  (`offers_token_ids`) take the exact tokens (`resume_token_ids`), so greedy and seeded sampling go on as
  if nothing had happened; any other engine gets text: completions prompt + text, chat an assistant prefix
  (`continue_final_message`, as vLLM and SGLang take it).
- `Stitcher` rewrites the continuation's chunks into the first stream's: its id and `created`, no second
  role, usage counted over both.

It never chooses endpoints, retries or writes to the client (the dispatcher and legs do).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.config.gateway_config import ProviderConfig
from gateway.server.client_stream import StreamUsage

_TOKEN_IDS = re.compile(rb',"token_ids":\[[0-9,]*\]')   # our workers' extension on a choice, digits only
_OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens")


class StreamBroken(Exception):
    """An upstream failed after its stream reached the client; the dispatcher may continue it elsewhere."""

    def __init__(self, endpoint_id: str, description: str, transcript: Transcript, usage: StreamUsage) -> None:
        super().__init__(f"{endpoint_id}: {description}")
        self.endpoint_id = endpoint_id
        self.description = description
        self.transcript = transcript
        self.usage = usage           # what the broken leg relayed, counted as its relay counted it


class Transcript:
    """The whole events one leg relayed to the client (references to the relayed chunks, no copies)."""

    __slots__ = ("_held", "chunks")

    def __init__(self, sent_before: bytes = b"") -> None:
        self.chunks: list[bytes] = [sent_before] if sent_before else []
        self._held = b""               # the start of an event whose end has not arrived

    def take_whole(self, chunk: bytes) -> bytes:
        """The part of `chunk` that completes events (what may go to the client now); the rest is held back."""
        if not self._held and chunk.endswith(b"\n\n"):
            self.chunks.append(chunk)
            return chunk
        data = self._held + chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        whole, self._held = data[:cut], data[cut:]
        if whole:
            self.chunks.append(whole)
        return whole

    def flush(self) -> bytes:
        """What is held back, at the stream's clean end (an upstream whose last event has no blank line)."""
        held, self._held = self._held, b""
        return held

    def events(self) -> list[Any]:
        """The JSON payloads of the relayed `data:` events, in order ([DONE] and comments left out)."""
        out = []
        for event in b"".join(self.chunks).replace(b"\r\n", b"\n").split(b"\n\n"):
            data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                try:
                    out.append(orjson.loads(data))
                except orjson.JSONDecodeError:
                    out.append(None)
        return out


@dataclass(frozen=True, slots=True)
class SoFar:
    """What the client has of a streamed answer, over every leg so far."""
    envelope: Mapping[str, Any]          # the first stream's id and created (the continuation's chunks get them)
    text: str                            # output text sent
    token_ids: tuple[int, ...] | None    # its token ids, when every leg sent them (our workers)
    num_tokens: int                      # output tokens sent (token ids, else content events)
    finished: bool                       # a finish_reason was sent: the answer is whole

    def then(self, later: SoFar) -> SoFar:
        """This, followed by what a continuation sent."""
        ids = None if self.token_ids is None or later.token_ids is None else self.token_ids + later.token_ids
        return SoFar(self.envelope, self.text + later.text, ids, self.num_tokens + later.num_tokens, later.finished)


def answered_so_far(transcript: Transcript, chat: bool) -> SoFar | None:
    """What the transcript's events gave the client; None when it cannot be continued: an error event,
    a choice other than index 0 (n > 1), tool calls, or an event that is not JSON."""
    envelope: dict[str, Any] = {}
    text: list[str] = []
    ids: list[int] | None = []
    num_events, finished = 0, False
    for payload in transcript.events():
        if not isinstance(payload, dict) or "error" in payload:
            return None
        if not envelope:
            envelope = {k: payload[k] for k in ("id", "created") if k in payload}
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return None
            if chat:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("function_call"):
                    return None
                piece = delta.get("content")
            else:
                piece = choice.get("text")
            token_ids = choice.get("token_ids")
            if ids is not None and isinstance(token_ids, list):
                ids.extend(token_ids)
            elif piece:
                ids = None            # text without its tokens: this upstream does not send them
            if isinstance(piece, str) and piece:
                text.append(piece)
                num_events += 1
            finished = finished or choice.get("finish_reason") is not None
    return SoFar(envelope, "".join(text), None if ids is None else tuple(ids),
                 num_events if ids is None else len(ids), finished)


def asks_token_ids(request_body: Mapping[str, Any]) -> bool:
    return request_body.get("return_token_ids") is True


def leg_body(config: ProviderConfig, body: Mapping[str, Any], raw: bytes, *, can_fail_over: bool,
             so_far: SoFar | None) -> tuple[bytes, bool] | None:
    """The body of a leg to `config`'s endpoints and whether the continuation's usage already counts the
    output so far; `raw` (the client's bytes) when nothing changes. With `can_fail_over` our workers are asked
    for token ids. For a continuation (`so_far`), None when this provider cannot continue it."""
    out: dict[str, Any] | None = None
    if config.upstream_model is not None and body.get("model") != config.upstream_model:
        out = {**body, "model": config.upstream_model}
    if can_fail_over and config.offers_token_ids and not asks_token_ids(body):
        out = {**(out or body), "return_token_ids": True}
    if so_far is None:
        return (raw, False) if out is None else (orjson.dumps(out), False)
    out = dict(out or body)
    if config.offers_token_ids and so_far.token_ids is not None:
        out["resume_token_ids"] = list(so_far.token_ids)   # max_tokens counts them: unchanged
        return orjson.dumps(out), True
    for limit in _OUTPUT_LIMITS:
        if isinstance(out.get(limit), int):
            if out[limit] <= so_far.num_tokens:
                return None
            out[limit] -= so_far.num_tokens
    if "messages" in out:
        *before, last = out["messages"]
        prefilled = out.get("continue_final_message") is True and isinstance(last, dict) and \
            last.get("role") == "assistant" and isinstance(last.get("content"), str)
        if prefilled:   # the answer continues the last message in place: so does its continuation
            out["messages"] = [*before, {**last, "content": last["content"] + so_far.text}]
        else:
            out["messages"] = [*out["messages"], {"role": "assistant", "content": so_far.text}]
        out.update(continue_final_message=True, add_generation_prompt=False)
    elif isinstance(out.get("prompt"), str):
        out["prompt"] += so_far.text
    else:
        return None    # a token-id prompt (or a batch) cannot take text
    return orjson.dumps(out), False


class Stitcher:
    """Rewrites a continuation's SSE chunks (whole events) so that they read as the first stream's."""

    __slots__ = ("_chat", "_envelope", "_usage_offset")

    def __init__(self, so_far: SoFar, chat: bool, usage_counts_so_far: bool) -> None:
        self._envelope = so_far.envelope
        self._chat = chat
        self._usage_offset = 0 if usage_counts_so_far else so_far.num_tokens

    def __call__(self, chunk: bytes) -> bytes:
        out = []
        for event in chunk.replace(b"\r\n", b"\n").split(b"\n\n"):
            if not event.startswith(b"data: {"):
                if event.strip():
                    out.append(event + b"\n\n")
                continue
            try:
                payload = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                out.append(event + b"\n\n")
                continue
            if isinstance(payload, dict) and self._rewrite(payload):
                out.append(b"data: " + orjson.dumps(payload) + b"\n\n")
        return b"".join(out)

    def _rewrite(self, payload: dict[str, Any]) -> bool:
        """False: drop the event (the continuation's opening role chunk, which says nothing new)."""
        if "error" in payload:
            return True
        payload.update(self._envelope)
        choices = payload.get("choices") or []
        if self._chat:
            for choice in choices:
                delta = choice.get("delta")
                if isinstance(delta, dict) and delta.pop("role", None) is not None and not delta.get("content") \
                        and choice.get("finish_reason") is None and len(choices) == 1 and "usage" not in payload:
                    return False
        usage = payload.get("usage")
        if isinstance(usage, dict) and self._usage_offset:
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                # The continuation's prompt held the output so far as text: count it as output again.
                usage["prompt_tokens"] = max(0, prompt - self._usage_offset)
                usage["completion_tokens"] = completion + self._usage_offset
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return True


def without_token_ids(chunk: bytes) -> bytes:
    """`chunk` without the `token_ids` the gateway asked our workers for (the client did not)."""
    return _TOKEN_IDS.sub(b"", chunk) if b'"token_ids"' in chunk else chunk
