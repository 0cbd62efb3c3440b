"""POST /v1/chat/completions and /v1/completions: validate, authenticate, charge the rate limit,
build the routing facts, dispatch, then settle limits and usage in the background.

Unknown body fields pass through untouched; nothing reaches an upstream before validation passes.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from enum import Enum
from typing import Any

import orjson
from aiohttp import web

from cache.block_hash import block_hashes
from gateway.access import caller_key
from gateway.api.admission import charge_rate_limit, settle, settle_now
from gateway.config import LimitsConfig, ModelConfig
from gateway.dispatch import RoutedRequest
from gateway.errors import BadRequest, GatewayError, NotFound, RequestTimeout
from gateway.services import SERVICES, Services
from gateway.state import MemoryStore
from gateway.streaming import StreamUsage
from gateway.tokenize import PromptTokens
from gateway.tracing import request_id_var
from policies.base import RequestFacts

SESSION_HEADER = "x-session-affinity"


class Surface(Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, Surface.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, Surface.COMPLETIONS)


async def _handle(request: web.Request, surface: Surface) -> web.StreamResponse:
    started_s = time.perf_counter()
    services = request.app[SERVICES]
    key = caller_key(request)
    raw = await _read_body(request, services.config.limits.body_timeout_s)
    body = parse_body(raw, surface, services.config.limits)
    model = services.config.models.get(body["model"])
    if model is None:
        raise NotFound(f"The model {body['model']!r} does not exist", param="model", code="model_not_found")
    stream = body.get("stream", False)
    with services.tracing.span("request") as span:
        if span is not None:
            span.set_attribute("switchyard.model", model.name)
            span.set_attribute("switchyard.request_id", request_id_var.get())
        prompt = _count_prompt(services, model, body, surface)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        num_expected = services.estimator.estimate(model.name, max_tokens)
        charged = await charge_rate_limit(services, key, prompt.num_tokens + num_expected) if key is not None else 0
        session_key = request.headers.get(SESSION_HEADER) or None
        session_id = f"{model.name}\x00{session_key}" if session_key else None
        session_endpoint = await services.store.get_session(session_id) if session_id else None
        facts = RequestFacts(
            model=model.name, num_prompt_tokens=prompt.num_tokens, num_expected_output_tokens=num_expected,
            block_hashes=tuple(block_hashes(prompt.token_ids, model.block_size)) if prompt.token_ids else (),
            session_key=session_key, session_endpoint=session_endpoint, block_size=model.block_size)
        routed = RoutedRequest(model, surface.value, body, raw, stream, facts, request_id_var.get(), started_s,
                               session_id)
        outcome = None
        status = 499  # the client went away
        try:
            outcome = await services.dispatcher.dispatch(request, routed)
            status = outcome.response.status
        except GatewayError as exc:
            status = exc.status
            raise
        finally:
            # Runs on errors and cancellation too: the charge is settled to what was really used.
            if key is not None:
                usage = outcome.usage if outcome is not None else StreamUsage()
                settling = settle(services, key, charged, prompt.num_tokens, usage)
                if isinstance(services.store, MemoryStore):
                    await settle_now(settling)  # in-process: never suspends, no task needed
                else:
                    services.background.spawn(settling)
            services.metrics.on_request(model.name, status)
    if outcome.endpoint_id is not None:
        services.estimator.observe(model.name, outcome.usage.num_output_tokens)
    return outcome.response


def _count_prompt(services: Services, model: ModelConfig, body: Mapping[str, Any], surface: Surface) -> PromptTokens:
    if surface is Surface.CHAT:
        return services.counter.count_chat(model.name, body["messages"])
    return services.counter.count_prompt(model.name, body["prompt"])


# --- validation ------------------------------------------------------------------------------------

async def _read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or 408 for a client that sends it too slowly to hold a connection with it."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s") from None


def parse_body(raw: bytes, surface: Surface, limits: LimitsConfig) -> dict[str, Any]:
    if not raw:
        raise BadRequest("The request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if surface is Surface.CHAT:
        _check_messages(body.get("messages"), limits.max_messages)
    else:
        _check_prompt(body.get("prompt"))
    _check_type(body, "stream", bool)
    _check_type(body, "stream_options", dict)
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = _check_type(body, name, int)
        if value is not None and value < 1:
            raise BadRequest(f"'{name}' must be at least 1", param=name)
        if value is not None and name != "n" and value > limits.max_output_tokens:
            raise BadRequest(f"'{name}' is {value}, above this gateway's ceiling of {limits.max_output_tokens}",
                             param=name)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _check_type(body, name, (int, float))
    return body


def _check_type(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
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


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt)
            or all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                   for p in prompt)):
        return
    raise BadRequest("'prompt' is required: a non-empty string, array of strings or array of token ids",
                     param="prompt")
