"""What the client sees of a disaggregated answer (gateway/upstream/providers/switchyard_pd.py): the prefill leg's
first token joined to the decode leg's answer, whole or as the stream's first chunk. Its text, token ids and
logprobs lead; usage counts the prompt and cached tokens the prefill reported and every output token."""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from gateway.server.client_stream import StreamUsage
from gateway.upstream.request import Outcome, Progress, RetryableFailure


@dataclass(frozen=True, slots=True)
class PrefillResult:
    endpoint_id: str                     # the prefill worker (it holds the blocks)
    payload: Mapping[str, Any]           # its completion response, kv_transfer_params removed
    text: str                            # the first token's text
    finish_reason: str | None            # as the prefill reported it ("stop": nothing is held)
    kv_transfer_params: Mapping[str, Any] | None  # what the decode leg sends back; None: nothing held
    usage: Mapping[str, Any]             # the prefill's usage (prompt and cached tokens are the request's)


def joined(held: PrefillResult, payload: dict[str, Any], endpoint_id: str) -> Outcome:
    """First token text + decode text; prompt/cached usage from the prefill, completion from the decode."""
    try:
        choice = payload["choices"][0]
        if "message" in choice:
            choice["message"]["content"] = held.text + (choice["message"].get("content") or "")
        else:
            choice["text"] = held.text + (choice.get("text") or "")
        if isinstance(choice.get("token_ids"), list):  # the token-id extension: the first token is the prefill's
            choice["token_ids"] = first_token_ids(held) + choice["token_ids"]
        if isinstance(first := first_logprobs(held), dict) and isinstance(rest := choice.get("logprobs"), dict):
            choice["logprobs"] = {k: first[k] + v if isinstance(v, list) and isinstance(first.get(k), list) else v
                                  for k, v in rest.items()}   # chat's content, completions' parallel lists
    except (KeyError, IndexError, TypeError):
        raise RetryableFailure("bad decode answer: no choices") from None
    decode_usage = payload.get("usage") or {}
    usage = usage_body(held.usage, decode_usage.get("completion_tokens", held.usage.get("completion_tokens", 1)))
    payload.update(id=held.payload.get("id", payload.get("id")), usage=usage)
    return Outcome(json_response(payload), endpoint_id, stream_usage(usage))


def decoded_whole(held: PrefillResult, payload: dict[str, Any], endpoint_id: str) -> Outcome:
    """A decode answer that is the whole answer (vLLM's decode server samples the first token again); prompt and
    cached tokens are the prefill's to report, as in `joined`."""
    decode_usage = payload.get("usage") or {}
    usage = usage_body(held.usage, decode_usage.get("completion_tokens", 0))
    payload.update(usage=usage)
    return Outcome(json_response(payload), endpoint_id, stream_usage(usage))


def usage_body(prefill_usage: Mapping[str, Any], num_completion: int) -> dict[str, Any]:
    num_prompt = prefill_usage.get("prompt_tokens", 0)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(prefill_usage)}}


def cached_tokens(usage: Mapping[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    return details.get("cached_tokens", 0) if isinstance(details, dict) else 0


def stream_usage(usage: Mapping[str, Any]) -> StreamUsage:
    return StreamUsage(usage["completion_tokens"], usage["prompt_tokens"], cached_tokens(usage), exact=True)


def json_response(payload: Mapping[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def chunk_base(progress: Progress, held: PrefillResult) -> dict[str, Any]:
    chat = progress.request.api_path.endswith("chat/completions")
    return {"id": held.payload.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": held.payload.get("created", int(time.time())), "model": held.payload.get("model")}


def first_token_ids(held: PrefillResult) -> list[int]:
    ids = held.payload["choices"][0].get("token_ids")
    return ids if isinstance(ids, list) else []


def first_logprobs(held: PrefillResult) -> Any:
    """The prefill's logprobs for the first token (None unless asked for). The decode leg's follow them: its
    completions `text_offset` counts on from the first token's text."""
    return held.payload["choices"][0].get("logprobs")


def sse_chunk(progress: Progress, held: PrefillResult, delta: Mapping[str, Any], finish_reason: str | None) -> bytes:
    """One SSE event as the upstream would stream it: chat `delta`, completions `text`."""
    if progress.request.api_path.endswith("chat/completions"):
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason}
    if "role" in delta:   # the first chunk carries the prefill's token
        if first_token_ids(held):
            choice["token_ids"] = first_token_ids(held)
        if first_logprobs(held) is not None:
            choice["logprobs"] = first_logprobs(held)
    return b"data: " + orjson.dumps({**chunk_base(progress, held), "choices": [choice]}) + b"\n\n"
