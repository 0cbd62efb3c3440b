"""POST /v1/embeddings, as OpenAI's embeddings API: parse the body, run each input through the engine as an
embedding sequence (prefilled in the engine's batch beside generation, then pooled instead of sampled:
backends/worker/pooler.py), answer the vectors in request order.

Errors are raised as `APIError` and rendered by the middleware in `app.py`; an input's faults name
`input` (the message says which one). Unknown fields are ignored, as on the generation routes.
"""
from __future__ import annotations

import asyncio
import base64
import enum
import struct
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web

from backends.core.engine_errors import EngineRequestError
from backends.core.outputs import SequenceOutput
from backends.server.app_keys import CONFIG_KEY, ENGINE_KEY, METRICS_KEY, TOKENIZER_KEY, WorkerEngine
from backends.server.errors import APIError, ErrorType, invalid_param, unsupported_param
from backends.server.fields import is_int, opt_int, read_json
from backends.server.openai_routes import json_response
from backends.server.protocol import MAX_SEQUENCES, parse_model

Input = str | tuple[int, ...]   # one input: a text, or its token ids
_INPUT_SHAPES = ("`input` must be a non-empty string, a non-empty array of strings, of integer token ids (one input) "
                 "or of arrays of integer token ids.")


class EncodingFormat(str, enum.Enum):
    FLOAT = "float"     # a JSON array of numbers
    BASE64 = "base64"   # the float32 little-endian bytes, base64-encoded (as OpenAI's)


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str                          # the served name the client asked for
    inputs: tuple[Input, ...]           # 1 to MAX_SEQUENCES, in request order
    encoding_format: EncodingFormat


async def embeddings(request: web.Request) -> web.Response:
    arrival_s = time.monotonic()
    app = request.app
    engine, tokenizer, metrics = app[ENGINE_KEY], app[TOKENIZER_KEY], app[METRICS_KEY]
    req = parse_embedding_request(await read_json(request), app[CONFIG_KEY].served_model_names,
                                  min(tokenizer.vocab_size, engine.vocab_size), engine.hidden_size)
    prompts = [tokenizer.encode_text(one) if isinstance(one, str) else one for one in req.inputs]
    for i, ids in enumerate(prompts):
        _check_length(i, len(ids), engine.max_model_len)
    try:
        outputs = await embed_all(engine, "embd-" + uuid.uuid4().hex, prompts)
    finally:
        metrics.observe_request_duration(time.monotonic() - arrival_s)
    return json_response(response_body(req, [_vector(out) for out in outputs],
                                       sum(out.num_prompt_tokens for out in outputs)))


def parse_embedding_request(body: Any, served_model_names: tuple[str, ...], vocab_size: int,
                            hidden_size: int) -> EmbeddingRequest:
    """Validate a decoded JSON body; raise APIError on the first bad field."""
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    model = parse_model(body, served_model_names)
    inputs = _parse_inputs(body.get("input"), vocab_size)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = EncodingFormat.FLOAT.value
    if not isinstance(encoding, str) or encoding not in {f.value for f in EncodingFormat}:
        raise invalid_param("encoding_format", "`encoding_format` must be 'float' or 'base64'.")
    dimensions = opt_int(body, "dimensions")
    if dimensions is not None and dimensions != hidden_size:
        raise unsupported_param("dimensions", f"This model's embeddings have {hidden_size} dimensions and cannot be "
                                f"shortened (it has no Matryoshka training): send dimensions={hidden_size} or none.")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_param("user", "`user` must be a string.")
    return EmbeddingRequest(model, inputs, EncodingFormat(encoding))


def _parse_inputs(value: Any, vocab_size: int) -> tuple[Input, ...]:
    """A string, a list of strings, a list of token ids (one input) or a list of such lists."""
    if value is None:
        raise APIError("`input` is required.", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        return (_text(value, "input"),)
    if not isinstance(value, list) or not value:
        raise invalid_param("input", _INPUT_SHAPES)
    if all(is_int(t) for t in value):
        return (_token_ids(value, vocab_size, "input"),)
    if len(value) > MAX_SEQUENCES:
        raise invalid_param("input", f"At most {MAX_SEQUENCES} inputs are allowed per request, got {len(value)}.")
    if all(isinstance(one, str) for one in value):
        return tuple(_text(one, f"input[{i}]") for i, one in enumerate(value))
    if all(isinstance(one, list) for one in value):
        return tuple(_token_ids(one, vocab_size, f"input[{i}]") for i, one in enumerate(value))
    raise invalid_param("input", _INPUT_SHAPES)


def _text(value: str, where: str) -> str:
    if not value:
        raise invalid_param("input", f"`{where}` is empty.")
    return value


def _token_ids(value: list[Any], vocab_size: int, where: str) -> tuple[int, ...]:
    if not value:
        raise invalid_param("input", f"`{where}` is an empty array of token ids.")
    if not all(is_int(t) and 0 <= t < vocab_size for t in value):
        raise invalid_param("input", f"`{where}` must hold integer token ids in [0, {vocab_size}).")
    return tuple(value)


def _check_length(index: int, num_tokens: int, max_model_len: int) -> None:
    if num_tokens == 0:
        raise invalid_param("input", f"`input[{index}]` has no tokens.")
    if num_tokens > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, input[{index}] "
                       f"has {num_tokens} tokens. Please shorten it.", param="input", code="context_length_exceeded")


async def embed_all(engine: WorkerEngine, request_id: str, prompts: list[tuple[int, ...]]) -> list[SequenceOutput]:
    """Each prompt's final output, side by side in the engine's batch. If one fails, or the handler is
    cancelled (the client went away), the task group cancels the others, which aborts their sequences."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(engine.embed(f"{request_id}-{i}", list(ids))) for i, ids in enumerate(prompts)]
    except* EngineRequestError as refused:   # the handler checked the inputs: a bound it does not know of
        raise APIError(str(refused.exceptions[0]) or "The engine refused the input.", param="input",
                       code="invalid_value") from None
    return [task.result() for task in tasks]


def _vector(out: SequenceOutput) -> bytes:
    if out.error is not None:
        raise APIError(f"The engine failed the input: {out.error}", status=HTTPStatus.INTERNAL_SERVER_ERROR,
                       error_type=ErrorType.SERVER)
    if out.embedding is None:
        raise APIError("The input was aborted by the engine.", status=HTTPStatus.SERVICE_UNAVAILABLE,
                       error_type=ErrorType.UNAVAILABLE)
    return out.embedding


def response_body(req: EmbeddingRequest, vectors: list[bytes], num_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings list: `vectors` in request order; every token is a prompt token."""
    data = [{"object": "embedding", "index": i, "embedding": _encode(vector, req.encoding_format)}
            for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _encode(vector: bytes, encoding: EncodingFormat) -> list[float] | str:
    """float32 little-endian bytes as OpenAI sends them: numbers, or those bytes in base64."""
    if encoding is EncodingFormat.BASE64:
        return base64.b64encode(vector).decode("ascii")
    return list(struct.unpack(f"<{len(vector) // 4}f", vector))
