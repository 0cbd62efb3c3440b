"""The `anthropic` provider kind: an Anthropic-compatible Messages API at the end of a model's chain.

One POST per request to `{endpoint}/v1/messages` with the provider's key as `x-api-key` and an
`anthropic-version`; the chat body and the answer (whole or streamed) are translated by
gateway/translate/anthropic/outbound.py. Chat requests only: anything else is handed on down the chain.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

import aiohttp
import orjson
from aiohttp import web
from opentelemetry.trace import SpanKind

from gateway.config.gateway_config import ConfigError, ProviderConfig
from gateway.routing.endpoints import Endpoint
from gateway.routing.load import Lease
from gateway.server.client_stream import ClientGone, SseCounter, StreamUsage, apply_usage, error_event
from gateway.translate.anthropic import API_VERSION
from gateway.translate.anthropic.outbound import (
    ChatChunks,
    Untranslatable,
    openai_error,
    to_chat_completion,
    to_messages_request,
)
from gateway.upstream.deadlines import TaskDeadline
from gateway.upstream.legs import CONNECT_ERRORS, MAX_ERROR_BODY, Legs
from gateway.upstream.providers.base import ProviderRun
from gateway.upstream.providers.openai import openai_wire
from gateway.upstream.request import Leg, LegKind, Outcome, Progress, ProviderExhausted, RetryableFailure

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"


class AnthropicProvider:
    def __init__(self, config: ProviderConfig) -> None:
        if config.prefill_endpoints:
            raise ConfigError(f"providers.{config.name}.prefill_endpoints: only for kind switchyard-pd or vllm-pd")
        self.config = config
        self._wire = replace(openai_wire(config), headers={
            "Content-Type": "application/json", "anthropic-version": API_VERSION, **config.auth_headers()})

    def start(self, progress: Progress, legs: Legs) -> ProviderRun:
        return partial(self._serve, progress, legs)

    async def _serve(self, progress: Progress, legs: Legs) -> Outcome:
        """One leg to the endpoint the model's policy picks among this provider's untried endpoints."""
        request = progress.request
        if request.api_path != CHAT_PATH:
            raise ProviderExhausted("an anthropic provider serves chat completions only", unsupported="")
        if progress.so_far is not None:   # the Messages API has no way to go on from part of an answer here
            raise ProviderExhausted("an anthropic provider does not continue a broken stream")
        try:
            body = to_messages_request(request.body, self.config.upstream_model or request.model.name)
        except Untranslatable as exc:
            raise ProviderExhausted(f"no Messages API form for {exc}", unsupported="") from None
        endpoint, decision, prefill_work = await legs.take(progress, self.config.name)
        with legs.tracing.span("upstream_attempt", SpanKind.CLIENT) as span:
            headers = legs.leg_headers(progress, span, self._wire, endpoint.endpoint_id, decision)
            leg = Leg(self._wire, endpoint, LegKind.SINGLE, MESSAGES_PATH, orjson.dumps(body), headers,
                      prefill_work, request.facts.num_expected_output_tokens)
            return await legs.send(progress, leg, partial(self._read, progress, legs, endpoint))

    async def _read(self, progress: Progress, legs: Legs, endpoint: Endpoint, response: aiohttp.ClientResponse,
                    first_byte_deadline: TaskDeadline, lease: Lease) -> Outcome:
        if response.status != 200:
            body = openai_error(await response.content.read(MAX_ERROR_BODY))
            return await legs.answer_error(response, body, endpoint.breaker, progress.client)
        if progress.client is None:
            return await self._read_whole(response, endpoint)
        options = progress.request.body.get("stream_options")
        chunks = ChatChunks(isinstance(options, dict) and options.get("include_usage") is True)
        first = await _first_chunks(response, chunks)
        first_byte_deadline.reschedule(None)
        lease.prefill_done()
        if first.startswith(b'data: {"error"'):   # the upstream refused before any text: try elsewhere
            endpoint.breaker.on_failure()
            raise RetryableFailure(f"stream error: {first[:200].decode(errors='replace')}")
        return await _relay_stream(progress, legs, endpoint, response, chunks, first, lease)

    async def _read_whole(self, response: aiohttp.ClientResponse, endpoint: Endpoint) -> Outcome:
        try:
            completion = to_chat_completion(orjson.loads(await response.read()))
        except (orjson.JSONDecodeError, ValueError):
            endpoint.breaker.on_failure()
            raise RetryableFailure("bad answer: not an Anthropic message") from None
        endpoint.breaker.on_success()
        usage = StreamUsage()
        apply_usage(usage, completion["usage"])
        return Outcome(web.Response(body=orjson.dumps(completion), content_type="application/json"),
                       endpoint.endpoint_id, usage)


async def _first_chunks(response: aiohttp.ClientResponse, chunks: ChatChunks) -> bytes:
    """Read until the translation has something to send (Anthropic opens with events that carry no text)."""
    while True:
        data = await response.content.readany()
        if not data:
            raise RetryableFailure("empty response: upstream closed before the first event")
        first = chunks.feed(data)
        if first:
            return first


async def _relay_stream(progress: Progress, legs: Legs, endpoint: Endpoint, response: aiohttp.ClientResponse,
                        chunks: ChatChunks, first: bytes, lease: Lease) -> Outcome:
    """Legs.relay_stream with the translation in the loop: OpenAI chunks to the client as events arrive."""
    client, model = progress.client, progress.request.facts.model
    assert client is not None
    counter = SseCounter()
    lease.on_output_tokens(counter.feed(first))
    is_first_data = not client.data_started
    await client.send_first(first, "text/event-stream")
    if is_first_data:
        legs.metrics.observe_ttft(model, time.perf_counter() - progress.request.started_s)
    try:
        while not chunks.ended and (data := await response.content.readany()):
            out = chunks.feed(data)
            if out:
                lease.on_output_tokens(counter.feed(out))
                await client.send(out)
    except ClientGone:
        raise
    except (TimeoutError, *CONNECT_ERRORS) as exc:
        endpoint.breaker.on_failure()
        legs.metrics.on_stream_error(model)
        log.warning("upstream %s failed mid-stream: %r", endpoint.endpoint_id, exc)
        await client.fail(error_event(f"upstream {endpoint.endpoint_id} failed mid-stream: {type(exc).__name__}"))
        return Outcome(await client.finish(), endpoint.endpoint_id, counter.usage)
    endpoint.breaker.on_success()
    if chunks.usage is not None:   # exact, whether or not the client asked for the usage chunk
        apply_usage(counter.usage, chunks.usage)
    return Outcome(await client.finish(), endpoint.endpoint_id, counter.usage)
