"""Mid-stream failover (docs/reliability.md): when an upstream dies after the client has part of a streamed
answer, the answer goes on elsewhere as a continuation, and the client sees one stream.

- `Transcript` keeps the events relayed to the client (and holds back a partial event, so the client never
  has half of one when the stream breaks).
- `answered_so_far` reads a broken stream's transcript into what the client has of each choice (`SoFar`,
  so_far.py).
- `continuation_body` builds a continuation's upstream body: the prompt plus the output so far. Our workers
  (`offers_token_ids`) take the exact tokens of each choice (`resume_token_ids`), so greedy and seeded
  sampling, `n` > 1, batches and tool calls go on as if nothing had happened; any other engine gets text:
  completions prompt + text (several choices as one batch: text_batch.py), chat an assistant prefix
  (`continue_final_message`, as vLLM and SGLang take it) for one choice of text.
- `Stitcher` rewrites the continuation's chunks into the first stream's: its id and `created`, no second
  role for a choice that had one, a text batch's choices back at the client's indices, usage counted over both.

It never chooses endpoints, retries or writes to the client (the dispatcher and legs do).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.config.gateway_config import ProviderConfig
from gateway.server.client_stream import StreamUsage
from gateway.upstream.so_far import ChoiceSoFar, SoFar
from gateway.upstream.text_batch import BatchRewrite, batch_body, text_batch

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


class _ChoiceReader:
    """One choice's events as `answered_so_far` reads them."""

    __slots__ = ("calls", "finished", "ids", "num_events", "text")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] | None = []
        self.num_events, self.finished, self.calls = 0, False, False

    def read(self, choice: dict[str, Any], chat: bool) -> None:
        calls = False
        if chat:
            delta = choice.get("delta") or {}
            calls = bool(delta.get("tool_calls") or delta.get("function_call"))
            piece = delta.get("content")
        else:
            piece = choice.get("text")
        token_ids = choice.get("token_ids")
        if self.ids is not None and isinstance(token_ids, list):
            self.ids.extend(token_ids)
        elif piece or calls:
            self.ids = None            # output without its tokens: this upstream does not send them
        if isinstance(piece, str) and piece:
            self.text.append(piece)
            self.num_events += 1
        self.calls = self.calls or calls
        self.finished = self.finished or choice.get("finish_reason") is not None

    def so_far(self) -> ChoiceSoFar:
        ids = None if self.ids is None else tuple(self.ids)
        return ChoiceSoFar("".join(self.text), ids, self.num_events if ids is None else len(ids), self.finished,
                           self.calls)


def answered_so_far(transcript: Transcript, chat: bool, num_choices: int = 1) -> SoFar | None:
    """What the transcript's events gave the client of each of its `num_choices` choices; None when it cannot be
    continued: an error event, a choice index out of range, or an event that is not JSON."""
    envelope: dict[str, Any] = {}
    readers = [_ChoiceReader() for _ in range(num_choices)]
    for payload in transcript.events():
        if not isinstance(payload, dict) or "error" in payload:
            return None
        if not envelope:
            envelope = {k: payload[k] for k in ("id", "created") if k in payload}
        for choice in payload.get("choices") or ():
            index = choice.get("index", 0) if isinstance(choice, dict) else None
            if not isinstance(index, int) or not 0 <= index < num_choices:
                return None
            readers[index].read(choice, chat)
    return SoFar(envelope, tuple(r.so_far() for r in readers))


def continuation_body(config: ProviderConfig, out: dict[str, Any], so_far: SoFar) -> tuple[bytes, bool] | None:
    """A continuation's body for `config`'s endpoints from `out` (the first leg's body, as `legs.leg_body` built
    it), and whether its usage already counts the output so far; None when this provider cannot continue it."""
    if config.offers_token_ids and all(c.token_ids is not None for c in so_far.choices):
        resumed = so_far.resume_token_ids()
        if resumed is not None:
            out["resume_token_ids"] = resumed   # max_tokens counts them: unchanged
        return orjson.dumps(out), True
    if len(so_far.choices) == 1 and not so_far.choices[0].calls and not isinstance(out.get("prompt"), list):
        return _text_continuation(out, so_far.choices[0])
    if "messages" in out:
        return None    # chat has no batch: several choices or tool calls need our workers' tokens
    batch = text_batch(out, so_far)
    return None if batch is None else (orjson.dumps(batch_body(out, batch)), False)


def _text_continuation(out: dict[str, Any], so_far: ChoiceSoFar) -> tuple[bytes, bool] | None:
    """`out` continuing `so_far` as text (any engine): the prompt, or an assistant prefix, ends with it."""
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

    __slots__ = ("_batch", "_chat", "_envelope", "_num_moved", "_num_not_run", "_started")

    def __init__(self, so_far: SoFar, chat: bool, usage_counts_so_far: bool,
                 body: Mapping[str, Any] | None = None) -> None:
        """`body`: the client's, whose text continuation of several choices was one batch (`leg_body`)."""
        self._envelope = so_far.envelope
        self._chat = chat
        batch = None if usage_counts_so_far or chat or body is None or len(so_far.choices) == 1 \
            else text_batch(body, so_far)
        self._batch = None if batch is None else BatchRewrite(batch, so_far)
        # Output the continuation's usage counts as prompt (text), and that of choices it did not run (whole ones).
        self._num_moved = 0 if usage_counts_so_far else so_far.num_tokens
        self._num_not_run = sum(c.num_tokens for c in so_far.choices if c.finished) if usage_counts_so_far else 0
        self._started = frozenset(i for i, c in enumerate(so_far.choices) if c.num_tokens or c.finished)

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
        if self._batch is not None:
            return self._rewrite_batch(payload)
        choices = payload.get("choices") or []
        if self._chat:   # a choice the client has part of has its role: a second one says nothing
            for choice in choices:
                delta = choice.get("delta")
                if isinstance(delta, dict) and choice.get("index", 0) in self._started \
                        and delta.pop("role", None) is not None and not delta.get("content") \
                        and not delta.get("tool_calls") and choice.get("finish_reason") is None \
                        and len(choices) == 1 and "usage" not in payload:
                    return False
        usage = payload.get("usage")
        if isinstance(usage, dict) and (self._num_moved or self._num_not_run):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                # Text: the continuation's prompt held the output so far, which counts as output again.
                usage["prompt_tokens"] = max(0, prompt - self._num_moved)
                usage["completion_tokens"] = completion + self._num_moved + self._num_not_run
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return True

    def read_back(self, leg: SoFar) -> SoFar:
        """What this continuation's leg (read at its own indices) gave the client of each of its choices."""
        return leg if self._batch is None else self._batch.read_back(leg)

    def _rewrite_batch(self, payload: dict[str, Any]) -> bool:
        assert self._batch is not None
        choices = payload.get("choices")
        if isinstance(choices, list) and choices:
            payload["choices"] = self._batch.choices(choices)
            if not payload["choices"] and "usage" not in payload:
                return False    # past its choice's budget: dropped
        if isinstance(payload.get("usage"), dict):
            self._batch.usage(payload["usage"])
        return True


def without_token_ids(chunk: bytes) -> bytes:
    """`chunk` without the `token_ids` the gateway asked our workers for (the client did not)."""
    return _TOKEN_IDS.sub(b"", chunk) if b'"token_ids"' in chunk else chunk
