"""The OpenAI surface of a worker: /v1/completions, /v1/chat/completions (streamed or not), /v1/models.

Handlers only glue parsing, tokenization, generation and response building together; errors are
raised as `APIError` and rendered by the middleware in `app.py`.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from backends.core.kv_transfer_params import KVTransferParams
from backends.server import disagg
from backends.server.app_keys import CONFIG_KEY, ENGINE_KEY, METRICS_KEY, TOKENIZER_KEY, WorkerEngine
from backends.server.choices import Choices
from backends.server.errors import APIError, invalid_param, model_not_found
from backends.server.fields import read_json
from backends.server.generation import SequenceSpec, generate_deltas, prior_output_text
from backends.server.protocol import (
    GenerateRequest,
    ParseContext,
    RequestKind,
    kv_transfer_params,
    parse_request,
    resolve_max_tokens,
)
from backends.server.responses import ResponseBuilder

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ID_PREFIX = {RequestKind.COMPLETION: "cmpl-", RequestKind.CHAT: "chatcmpl-"}


def json_response(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, RequestKind.COMPLETION)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, RequestKind.CHAT)


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": _model_cards(request)})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: one served name's card (`client.models.retrieve`); 404 model_not_found."""
    name = request.match_info["model"]
    card = next((c for c in _model_cards(request) if c["id"] == name), None)
    if card is None:
        raise model_not_found(name)
    return json_response(card)


def _model_cards(request: web.Request) -> list[dict[str, Any]]:
    max_model_len = request.app[ENGINE_KEY].max_model_len
    return [{"id": name, "object": "model", "created": 0, "owned_by": "switchyard", "max_model_len": max_model_len}
            for name in request.app[CONFIG_KEY].served_model_names]


async def _generate(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    arrival_s = time.monotonic()
    app = request.app
    engine, tokenizer = app[ENGINE_KEY], app[TOKENIZER_KEY]
    # Ids the model embeds but the tokenizer cannot print are refused too.
    ctx = ParseContext(app[CONFIG_KEY].served_model_names, min(tokenizer.vocab_size, engine.vocab_size))
    body = await read_json(request)
    req = parse_request(kind, body, ctx)
    assert isinstance(body, dict)  # parse_request refused anything else
    kv_params = kv_transfer_params(body)
    request_id = _ID_PREFIX[kind] + uuid.uuid4().hex
    if kv_params is not None and req.resume_token_ids:
        raise invalid_param("resume_token_ids", "`resume_token_ids` cannot be combined with `kv_transfer_params`.")
    if req.tools is not None and req.tools.calls and kv_params is not None:
        raise invalid_param("kv_transfer_params", "A forced tool call is answered whole by one worker: it is not "
                            "split into legs.")
    if kv_params is not None and req.num_sequences != 1:
        raise invalid_param("n" if req.num_choices != 1 else "prompt",
                            "A disaggregated leg samples one sequence: one prompt, n=1.")
    if req.num_sequences > 1:
        prompts = [(ids, resolve_max_tokens(one, len(ids), engine.max_model_len))
                   for one in req.each_prompt() for ids in (tokenizer.encode_request(one),)]
        return await _respond_choices(request, req, Choices(engine, tokenizer, app[METRICS_KEY], req, prompts,
                                                            request_id, arrival_s))
    prompt_ids = tokenizer.encode_request(req)
    if kv_params is not None and kv_params.get("do_remote_decode") is True:
        return await disagg.prefill_leg(request, kind, req, prompt_ids, request_id, arrival_s)
    if kv_params is not None:
        spec, builder = disagg.decode_leg(app, kind, req, prompt_ids, kv_params, request_id, arrival_s)
        with disagg.kv_load_errors(app, request_id):
            return await respond(request, req, engine, spec, builder)
    params = resolve_max_tokens(req, len(prompt_ids), engine.max_model_len)
    resumed = req.resume_token_ids
    if len(resumed) >= params.max_tokens:
        raise invalid_param("resume_token_ids", f"{len(resumed)} resumed tokens leave nothing to generate "
                            f"within max_tokens ({params.max_tokens}).")
    # Resumed tokens are output already sent (by a worker that died mid-stream): the sequence starts with them
    # as its first outputs, so sampling, penalties, stop strings and usage go on as if it had made them itself.
    spec = SequenceSpec(request_id, prompt_ids + resumed, params, req.skip_special_tokens, arrival_s,
                        num_prior_output_tokens=len(resumed),
                        kv_transfer=KVTransferParams(first_token_ids=resumed) if resumed else None)
    prior_text = prior_output_text(tokenizer.backend, spec) if resumed and req.tools is not None else ""
    builder = ResponseBuilder(kind, request_id, req.model, tokenizer, return_token_ids=req.return_token_ids,
                              prior_completion_ids=resumed, tools=req.tools, prior_text=prior_text)
    return await respond(request, req, engine, spec, builder)


async def respond(request: web.Request, req: GenerateRequest, engine: WorkerEngine, spec: SequenceSpec,
                  builder: ResponseBuilder) -> web.StreamResponse:
    """Generate `spec` on `engine` and answer: SSE chunks or one JSON body."""
    tokenizer, metrics = request.app[TOKENIZER_KEY], request.app[METRICS_KEY]
    try:
        async with aclosing(generate_deltas(engine, tokenizer.backend, spec, metrics)) as deltas:
            if req.stream:
                return await stream(request, req, (builder.chunk(delta) async for delta in deltas),
                                    builder.usage_chunk)
            collected = [delta async for delta in deltas]
            return json_response(builder.final(collected))
    finally:
        metrics.observe_request_duration(time.monotonic() - spec.arrival_s)


async def _respond_choices(request: web.Request, req: GenerateRequest, choices: Choices) -> web.StreamResponse:
    """Several sequences (n > 1, a batch of prompts): generated side by side, answered as SSE chunks or one
    JSON body."""
    try:
        async with choices:
            if req.stream:
                return await stream(request, req, choices.chunks(), choices.usage_chunk)
            return json_response(await choices.final())
    finally:
        request.app[METRICS_KEY].observe_request_duration(time.monotonic() - choices.arrival_s)


async def stream(request: web.Request, req: GenerateRequest, chunks: AsyncIterator[dict[str, Any]],
                 usage_chunk: Callable[[], dict[str, Any]]) -> web.StreamResponse:
    """SSE: headers go out with the first chunk, so a refusal before it is still a plain 4xx."""
    first = await anext(chunks)
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    try:
        await _send(response, first)
        async for chunk in chunks:
            await _send(response, chunk)
        if req.include_usage:
            await _send(response, usage_chunk())
    except APIError as exc:   # after the first byte the status is sent: report in-band
        log.warning("stream failed: %s", exc.message)
        await _send(response, exc.body())
    except ConnectionResetError:   # the client went away; leaving the context aborts the sequence
        log.info("client disconnected mid-stream")
        return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, body: object) -> None:
    await response.write(b"data: " + orjson.dumps(body) + b"\n\n")
