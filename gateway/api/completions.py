"""POST /v1/chat/completions, /v1/completions and /v1/embeddings: parse, resolve the model (`model_for`, which
every API surface uses), count the prompt, admit (the rate limit), route, relay; the rate-limit charge is
settled on every way out. Who the caller is was settled by the access middleware.

The rate limit is a step here, not a middleware: it charges the prompt's token count, which needs the
parsed body and the model's tokenizer; a middleware would have to parse and count the body twice.
Unknown body fields pass through untouched; nothing reaches an upstream before validation passes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import orjson
from aiohttp import web
from opentelemetry.trace import SpanKind

from cache.block_hash import block_hashes
from gateway.api.admission import Charge, charge_rate_limit, settle
from gateway.config.gateway_config import LimitsConfig, ModelConfig
from gateway.errors import BadRequest, GatewayError, NotFound, RequestTimeout
from gateway.routing.response_cache import CACHE_HEADER, CachePlan, ResponseCache
from gateway.routing.token_count import PromptTokens
from gateway.server.access_log import ACCESS_RECORD, AccessRecord
from gateway.server.client_stream import ClientGone, ClientStream, SseResponseFactory, StreamUsage
from gateway.server.lean_http import LeanRequest
from gateway.server.middlewares import API_KEY, caller_key
from gateway.services import SERVICES, Services
from gateway.telemetry.tracing import request_id_var
from gateway.upstream.request import EMBEDDINGS_PATH, Outcome, RoutedRequest, num_sequences
from policies.base import RequestFacts

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-affinity"


class Surface(Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = EMBEDDINGS_PATH


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, Surface.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, Surface.COMPLETIONS)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _handle(request, Surface.EMBEDDINGS)


async def _handle(request: web.Request, surface: Surface) -> web.StreamResponse:
    started_s = time.perf_counter()
    services = request.app[SERVICES]
    raw = await read_body(request, services.config.limits.body_timeout_s)
    body = parse_body(raw, surface, services.config.limits)
    return (await serve(request, surface, body, raw, started_s)).response


def model_for(request: web.Request, name: Any) -> ModelConfig:
    """The configured model `name` (or that one of its aliases names) where the caller's key may use it; else
    404 `model_not_found`, one answer for a model that is not there and one the key may not use (as OpenAI
    answers both)."""
    model = request.app[SERVICES].models_by_name.get(name) if isinstance(name, str) else None
    key = request.get(API_KEY)
    if model is None or (key is not None and not key.may_use(model.name)):
        raise NotFound(f"The model {name!r} does not exist or you do not have access to it", param="model",
                       code="model_not_found")
    return model


async def serve(request: web.Request, surface: Surface, body: Mapping[str, Any], raw: bytes, started_s: float,
                sse_response: Callable[[RoutedRequest], SseResponseFactory] | None = None) -> Outcome:
    """Count, admit, route and dispatch a validated body (`raw`: its bytes as forwarded upstream). Another
    API surface translated into this one passes `sse_response` to re-encode a streamed answer."""
    services = request.app[SERVICES]
    model = model_for(request, body["model"])
    if body["model"] != model.name:     # an alias: upstreams know the model by its name
        body = {**body, "model": model.name}
        raw = orjson.dumps(body)
    with services.tracing.span("request", SpanKind.SERVER, request.headers) as span:
        if span is not None:
            span.set_attribute("switchyard.model", model.name)
            span.set_attribute("switchyard.request_id", request_id_var.get())
        prompt = _count_prompt(services, model, body, surface)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        num_seqs = num_sequences(body)   # each samples its own output
        generates = surface is not Surface.EMBEDDINGS
        num_expected = num_seqs * services.estimator.estimate(model.name, max_tokens) if generates else 0
        key = caller_key(request)
        cache = services.response_cache
        plan = cache.plan(request.headers, surface.value, model, body, key.key_id if key else None) \
            if cache is not None and cache.enabled_for(model) else None
        charge = await charge_rate_limit(services, key, prompt.num_tokens + num_expected) if key is not None else None
        cached = await cache.read(plan) if cache is not None and plan is not None else None
        session_key = request.headers.get(SESSION_HEADER) or None
        session_id = f"{model.name}\x00{session_key}" if session_key else None
        session_endpoint = await services.store.get_session(session_id) if session_id and cached is None else None
        facts = RequestFacts(
            model=model.name, num_prompt_tokens=prompt.num_tokens, num_expected_output_tokens=num_expected,
            block_hashes=tuple(block_hashes(prompt.token_ids, model.block_size)) if prompt.token_ids else (),
            session_key=session_key, session_endpoint=session_endpoint, block_size=model.block_size)
        routed = RoutedRequest(model, surface.value, body, raw, body.get("stream", False), facts,
                               request_id_var.get(), started_s, session_id)
        new_response = sse_response(routed) if sse_response is not None and routed.stream else None
        client = services.dispatcher.client_stream(request, new_response) if routed.stream else None
        cache_result = None if plan is None else "hit" if cached is not None else plan.header
        if (record := request.get(ACCESS_RECORD)) is not None:
            record.model, record.stream, record.counted_prompt_tokens = model.name, routed.stream, prompt.num_tokens
            record.cache = cache_result
        headers = None if charge is None and cache_result is None else _answer_headers(charge, cache_result)
        if client is not None:
            client.extra_headers = headers
        if cached is not None:
            return await _answer_from_cache(services, routed, charge, cached, client, headers)
        if plan is not None:
            services.metrics.on_response_cache(model.name, plan.header)
            if client is not None and plan.key is not None and cache is not None:
                client.record(cache.max_entry_bytes)
        outcome = await _dispatch(services, routed, charge, client, record)
    if client is None and headers is not None:
        outcome.response.headers.update(headers)
    if cache is not None and plan is not None and plan.key is not None:
        _keep(services, cache, plan, outcome, client)
    if outcome.endpoint_id is not None and generates:
        services.estimator.observe(model.name, outcome.usage.num_output_tokens // num_seqs)
    return outcome


def _keep(services: Services, cache: ResponseCache, plan: CachePlan, outcome: Outcome,
          client: ClientStream | None) -> None:
    """Into the response cache, in the background: a whole answer (the cache keeps 200s alone), or a stream
    recorded whole."""
    if client is None:
        if isinstance(outcome.response, web.Response):
            services.background.spawn(cache.keep(plan, outcome.response.status, outcome.response.body))
    elif (recorded := client.recorded()) is not None:
        services.background.spawn(cache.keep(plan, 200, recorded))


def _answer_headers(charge: Charge | None, cache_result: str | None) -> dict[str, str] | None:
    """The answer's own headers: the key's x-ratelimit-* and the response cache's result (None: neither)."""
    limits = charge.headers if charge is not None else None
    if cache_result is None:
        return limits
    return {**limits, CACHE_HEADER: cache_result} if limits else {CACHE_HEADER: cache_result}


async def _answer_from_cache(services: Services, routed: RoutedRequest, charge: Charge | None, body: bytes,
                             client: ClientStream | None, headers: dict[str, str] | None) -> Outcome:
    """An answer kept by the response cache: no upstream, no tokens charged (the request still counts). A
    stream's events go to `client` in one write, re-encoded there for another API surface."""
    if charge is not None:
        await settle(services, charge, 0, StreamUsage())
    model = routed.model.name
    services.metrics.on_response_cache(model, "hit")
    if client is None:
        services.metrics.on_request(model, 200)
        return Outcome(web.Response(body=body, content_type="application/json", headers=headers), None, StreamUsage())
    status = 499
    try:
        await client.send_first(body, "text/event-stream")
        response = await client.finish()
        status = 200
    except ClientGone:      # nobody reads this response
        response = client.response or web.Response(status=499)
    finally:
        services.metrics.on_request(model, status)
        await client.close()
    return Outcome(response, None, StreamUsage())


async def _dispatch(services: Services, routed: RoutedRequest, charge: Charge | None,
                    client: ClientStream | None, record: AccessRecord | None) -> Outcome:
    """The dispatcher's outcome; on errors and cancellation too, the charge is settled to what was really
    used and the request is counted. A client that closed once it had the whole stream (the OpenAI SDK
    closes at `data: [DONE]`, often before the upstream's body has ended) was served: a 200; one that left
    before is a 499, charged for what was relayed to it. The access log's `record` gets the same figures."""
    outcome = None
    status = 499  # the client went away
    try:
        outcome = await services.dispatcher.dispatch(routed, client)
        status = outcome.response.status
        return outcome
    except GatewayError as exc:
        status = exc.status
        raise
    except ClientGone:      # aiohttp ignores the response of a closed connection
        assert client is not None and client.response is not None
        return Outcome(client.response, None, client.usage)
    finally:
        if outcome is None and client is not None and client.ended:
            status = 200
        usage = outcome.usage if outcome is not None else client.usage if client is not None else StreamUsage()
        if charge is not None:
            await settle(services, charge, routed.facts.num_prompt_tokens, usage)
        metrics = services.metrics
        metrics.on_request(routed.model.name, status)
        if usage.served:      # as usage records count it
            metrics.on_tokens(routed.model.name, charge.key.key_id if charge is not None else "",
                              usage.prompt_tokens(routed.facts.num_prompt_tokens), usage.num_cached_tokens,
                              usage.num_output_tokens)
        if record is not None:
            record.ended(status, outcome.endpoint_id if outcome is not None else None, usage,
                         client.first_data_s if client is not None else None)
        if client is not None:
            await client.close()    # last: it re-raises a cancellation


def _count_prompt(services: Services, model: ModelConfig, body: Mapping[str, Any], surface: Surface) -> PromptTokens:
    if surface is Surface.CHAT:
        return services.counter.count_chat(model.name, body["messages"], body.get("continue_final_message") is True,
                                           body.get("tools"))
    return services.counter.count_prompt(model.name, body["input" if surface is Surface.EMBEDDINGS else "prompt"])


# --- validation ------------------------------------------------------------------------------------

async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or 408 for a client that sends it too slowly to hold a connection with it."""
    if isinstance(request, LeanRequest) and request.body_complete:
        return await request.read()     # it came with the head (the usual case): nothing to time
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s") from None


def decode_json(raw: bytes) -> Any:
    """A request body's JSON (any value), or a 400 for an empty or malformed one."""
    if not raw:
        raise BadRequest("The request body is empty; expected a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from None


def parse_body(raw: bytes, surface: Surface, limits: LimitsConfig) -> dict[str, Any]:
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    check_body(body, surface, limits)
    return body


def check_body(body: Mapping[str, Any], surface: Surface, limits: LimitsConfig) -> None:
    """The fields the gateway reads (or caps) have the right types and bounds."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if surface is Surface.CHAT:
        _check_messages(body.get("messages"), limits.max_messages)
    elif surface is Surface.COMPLETIONS:
        _check_prompt(body.get("prompt"), "prompt")
    else:
        _check_prompt(body.get("input"), "input")
        if "stream" in body:
            raise BadRequest("'stream' is not a field of an embeddings request", param="stream")
    for name in body:   # in the body's order: the first bad field is the one reported
        kind = _CHECKED.get(name)
        if kind is None:
            continue
        if kind is _Internal:
            raise BadRequest(f"'{name}' is not accepted from clients: the gateway sets it on its own requests to "
                             f"its workers", param=name)
        value = _check_type(body, name, kind)
        if kind is not int or value is None:
            continue
        if value < 1:
            raise BadRequest(f"'{name}' must be at least 1", param=name)
        if name != "n" and value > limits.max_output_tokens:
            raise BadRequest(f"'{name}' is {value}, above this gateway's ceiling of {limits.max_output_tokens}",
                             param=name)


class _Internal:
    """The kind of a field that only the gateway sends to its workers (below)."""

# The optional fields the gateway reads or caps, and their types (the counts at least 1, the token counts
# at most limits.max_output_tokens). `_Internal`: a field between the gateway and our workers, refused from a
# client, since the body goes upstream as it came: `kv_transfer_params` would have a worker connect to the
# host and port it names (to pull KV) or hold a prompt's KV blocks for a decode that never comes, and
# `resume_token_ids` would put words in the model's mouth as output already counted (docs/reliability.md, Security).
_CHECKED: dict[str, type | tuple[type, ...]] = {
    "stream": bool, "stream_options": dict, "max_tokens": int, "max_completion_tokens": int, "n": int,
    "temperature": (int, float), "top_p": (int, float), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "kv_transfer_params": _Internal, "resume_token_ids": _Internal}


def _check_type(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else "number"
        raise BadRequest(f"'{name}' must be of type {expected}", param=name)
    return value


def _check_messages(messages: Any, max_messages: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty array", param="messages")
    if len(messages) > max_messages:
        raise BadRequest(f"'messages' has {len(messages)} entries; at most {max_messages} are accepted",
                         param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}] must be an object with a string 'role'", param=f"messages[{index}]")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{index}].content must be a string or an array",
                             param=f"messages[{index}].content")


MAX_TOKEN_ID = 2**32 - 1  # block hashes pack ids as uint32 (cache/block_hash.py); no vocabulary comes near


def _check_prompt(prompt: Any, name: str) -> None:
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(_is_token_id(p) for p in prompt)
            or all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt)):
        return
    raise BadRequest(f"'{name}' is required: a non-empty string, array of strings or array of token ids "
                     f"(integers in [0, {MAX_TOKEN_ID}])", param=name)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID
