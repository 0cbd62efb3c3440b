"""POST /v1/messages: Anthropic's Messages API over the same admission, routing and dispatch as chat
completions (`completions.serve`): session affinity, rate limits, retries and fallback apply unchanged.
The translation is gateway/translate/anthropic/inbound.py; this module only wires it to the request and response.
Every error on this route, the access middleware's included, has Anthropic's shape (`error_response`).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import orjson
from aiohttp import web

from gateway.api.completions import Surface, check_body, decode_json, model_for, read_body, serve
from gateway.api.reencoded import reencoded_response_class
from gateway.errors import GatewayError
from gateway.routing.response_cache import CACHE_HEADER
from gateway.server.client_stream import SseResponseFactory
from gateway.services import SERVICES
from gateway.translate.anthropic import inbound
from gateway.translate.anthropic.inbound import MessageEvents, MessageHeader
from gateway.upstream.request import RoutedRequest

ROUTE = "/v1/messages"
COUNT_TOKENS_ROUTE = "/v1/messages/count_tokens"
VERSION_HEADER = "anthropic-version"


async def create_message(request: web.Request) -> web.StreamResponse:
    started_s = time.perf_counter()
    services = request.app[SERVICES]
    inbound.check_version(request.headers.get(VERSION_HEADER))
    raw = await read_body(request, services.config.limits.body_timeout_s)
    body = decode_json(raw)
    chat = inbound.to_chat_body(body)
    check_body(chat, Surface.CHAT, services.config.limits)
    header = MessageHeader(f"msg_{uuid.uuid4().hex}", chat["model"], inbound.stop_sequences(body))
    outcome = await serve(request, Surface.CHAT, chat, orjson.dumps(chat), started_s,
                          partial(_sse_response, header, reencoded_response_class(request)))
    return _translated(outcome.response, header)


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt tokens a Messages request would have, by the model's
    tokenizer and chat template as the gateway counts them for routing (an estimate where no tokenizer is
    configured). Nothing is sent upstream."""
    services = request.app[SERVICES]
    inbound.check_version(request.headers.get(VERSION_HEADER))
    body = decode_json(await read_body(request, services.config.limits.body_timeout_s))
    if isinstance(body, dict) and body.get("max_tokens") is None:
        body = {**body, "max_tokens": 1}    # counting takes no max_tokens; the translation needs one
    chat = inbound.to_chat_body(body)
    check_body(chat, Surface.CHAT, services.config.limits)
    model = model_for(request, chat["model"])
    counted = services.counter.count_chat(model.name, chat["messages"], chat.get("continue_final_message") is True,
                                          chat.get("tools"))
    return web.Response(body=orjson.dumps({"input_tokens": counted.num_tokens}), content_type="application/json")


_KEPT_HEADERS = frozenset({"retry-after", CACHE_HEADER})


def _translated(response: web.StreamResponse, header: MessageHeader) -> web.StreamResponse:
    """A whole answer (or an upstream's relayed error) in Anthropic's shape; a stream went out translated."""
    if response.prepared or not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return response
    status = response.status
    if status != 200:
        body = inbound.error_from_openai(status, response.body)
    else:
        try:
            body = inbound.to_message(orjson.loads(response.body), header)
        except orjson.JSONDecodeError:
            status, body = 502, inbound.error_body(502, "the upstream's answer is not JSON")
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers={k: v for k, v in response.headers.items() if k.lower() in _KEPT_HEADERS})


def _sse_response(header: MessageHeader, response_class: Callable[..., web.StreamResponse],
                  routed: RoutedRequest) -> SseResponseFactory:
    """The streamed response's factory: message_start carries the gateway's prompt count."""
    events = MessageEvents(replace(header, num_input_tokens=routed.facts.num_prompt_tokens))
    return partial(response_class, events=events)


def error_response(error: GatewayError) -> web.Response:
    """The error middleware's renderer for this route."""
    return web.Response(status=error.status, body=orjson.dumps(inbound.error_body(error.status, error.message)),
                        content_type="application/json", headers=error.headers)
