"""OpenAI response bodies and stream chunks for completions and chat, built from generation deltas.

Pure formatting: dicts ready for orjson; no I/O, no engine. Field names follow the OpenAI API;
the extensions on a choice are `token_ids` (asked for with `return_token_ids`) and, on the last one,
vLLM's `stop_reason` (the stop string that ended the output, else null). A forced tool call's text is answered
as `tool_calls` (tool_call_output.py), finished with "tool_calls" when "required" forced it (OpenAI's "stop"
when the call was named).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.core.outputs import FinishReason, TokenLogprob
from backends.server.generation import GenerationDelta
from backends.server.protocol import RequestKind
from backends.server.tokenization import PromptTokenizer
from backends.server.tool_call_output import ToolCallText
from backends.server.tools import ToolCalling


@dataclass(frozen=True, slots=True)
class Usage:
    num_prompt_tokens: int
    num_cached_tokens: int       # prompt tokens served from the prefix cache
    num_completion_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


class ResponseBuilder:
    """Builds one request's chunks (streaming) or final body; tracks usage and text offsets."""

    def __init__(
        self, kind: RequestKind, response_id: str, model: str, tokenizer: PromptTokenizer, *, return_token_ids: bool,
        prior_completion_ids: Sequence[int] = (), index: int = 0, tools: ToolCalling | None = None,
        prior_text: str = "",
    ) -> None:
        """`prior_completion_ids`: output tokens the client got from elsewhere (a decode leg's first token, a
        resumed stream's tokens): counted in usage and in completions' `text_offset`, not sent; `prior_text`:
        their text, where a forced tool call's deltas go on from it. `index`: the choice this builder's sequence
        is (one of `n`)."""
        self._kind = kind
        self._index = index
        self._id = response_id
        self._model = model
        self._tokenizer = tokenizer
        self._return_token_ids = return_token_ids
        self._created = int(time.time())
        self._text_offset = sum(len(self._token_text(t)) for t in prior_completion_ids) \
            if kind is RequestKind.COMPLETION else 0   # completions logprobs: characters before the next token
        self._role_sent = bool(prior_completion_ids)   # chat: the stream that began elsewhere has it
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._num_completion_tokens = len(prior_completion_ids)
        self._calls = ToolCallText(tools) if tools is not None and tools.calls and kind is RequestKind.CHAT else None
        self._calls_finish = "tool_calls" if tools is not None and tools.forced is None else "stop"
        if self._calls is not None and prior_text:
            self._calls.feed(prior_text)   # the calls' heads and arguments so far reached the client from elsewhere

    @property
    def usage(self) -> Usage:
        return Usage(self._num_prompt_tokens, self._num_cached_tokens, self._num_completion_tokens)

    def chunk(self, delta: GenerationDelta) -> dict[str, Any]:
        """One stream chunk for `delta` (the first chat chunk of the stream also carries the role)."""
        self._count(delta)
        choice: dict[str, Any] = {"index": self._index}
        if self._kind is RequestKind.CHAT:
            message: dict[str, Any] = {"content": delta.text}
            if self._calls is not None:
                calls = self._calls.feed(delta.text)
                message = {"content": None} if not self._role_sent else {}
                if calls:
                    message["tool_calls"] = calls
            if not self._role_sent:
                message = {"role": "assistant", **message}
                self._role_sent = True
            choice["delta"] = message
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs(delta.logprobs)
        choice["finish_reason"] = self._finish_reason(delta.finish_reason)
        if delta.finish_reason:
            choice["stop_reason"] = delta.stop_string
        if self._return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
        return self._envelope([choice], stream=True)

    def usage_chunk(self, usage: Usage | None = None) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: usage (this sequence's by default) and no
        choices."""
        body = self._envelope([], stream=True)
        body["usage"] = (usage or self.usage).body()
        return body

    def final(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        """The non-streaming body from all of a sequence's deltas."""
        for delta in deltas:
            self._count(delta)
        text = "".join(d.text for d in deltas)
        token_ids = [t for d in deltas for t in d.token_ids]
        logprobs = None
        if deltas and deltas[0].logprobs is not None:
            logprobs = tuple(lp for d in deltas for lp in (d.logprobs or ()))
        finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
        choice: dict[str, Any] = {"index": self._index}
        if self._calls is not None:
            self._calls.feed(text)
            choice["message"] = {"role": "assistant", "content": None,
                                 "tool_calls": [call.body() for call in self._calls.calls]}
        elif self._kind is RequestKind.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = self._finish_reason(finish)
        choice["stop_reason"] = next((d.stop_string for d in reversed(deltas) if d.finish_reason), None)
        if self._return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope([choice], stream=False)
        body["usage"] = self.usage.body()
        return body

    def _finish_reason(self, finish: FinishReason | None) -> str | None:
        if finish is FinishReason.STOP and self._calls is not None:
            return self._calls_finish
        return finish.value if finish else None

    def _count(self, delta: GenerationDelta) -> None:
        self._num_prompt_tokens = delta.num_prompt_tokens
        self._num_cached_tokens = delta.num_cached_tokens
        self._num_completion_tokens += len(delta.token_ids)

    def _envelope(self, choices: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
        if self._kind is RequestKind.CHAT:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model, "choices": choices}

    def _logprobs(self, logprobs: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        if self._kind is RequestKind.CHAT:
            return {"content": [self._chat_logprob(lp) for lp in logprobs]}
        return self._completion_logprobs(logprobs)

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        token_bytes = self._tokenizer.token_bytes   # the token's own: a piece of a character is not U+FFFD's
        return {
            "token": self._token_text(lp.token_id),
            "logprob": lp.logprob,
            "bytes": list(token_bytes(lp.token_id)),
            "top_logprobs": [
                {"token": self._token_text(tid), "logprob": v, "bytes": list(token_bytes(tid))} for tid, v in lp.top
            ],
        }

    def _completion_logprobs(self, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token_text(tid): v for tid, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.backend.decode([token_id], skip_special_tokens=False)
