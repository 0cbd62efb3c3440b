"""Turns a routed request into upstream legs: pick an endpoint (the model's policy over the chain's
candidates), hold a load lease, send, relay; on a failure before the first byte, retry elsewhere.

It never parses client input (the API handlers do) and never decides scores (the policies do).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from cache.prefix_index import PrefixIndex
from gateway.breaker import CircuitBreaker, eligible
from gateway.config import ModelConfig
from gateway.errors import GatewayError, NoUpstreamAvailable, UpstreamsFailed
from gateway.fallback import Retrier, RetryableFailure
from gateway.load import Lease, LoadTracker
from gateway.metrics import Metrics
from gateway.providers import LegRequest, Provider
from gateway.state import StateStore
from gateway.streaming import ClientGone, ClientStream, SseCounter, StreamUsage, apply_usage, error_event
from gateway.tracing import REQUEST_ID_HEADER, Tracing
from gateway.upstreams import Endpoint, UpstreamRegistry
from policies.base import Decision, EndpointState, Policy, RequestFacts

log = logging.getLogger(__name__)

_MAX_ERROR_BODY = 64 * 1024
_CONNECT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    model: ModelConfig                  # the client's model, resolved from config
    api_path: str                       # "/v1/chat/completions" or "/v1/completions"
    body: Mapping[str, Any]             # the parsed client body
    raw: bytes                          # the client body as received (forwarded when unchanged)
    stream: bool                        # the client asked for SSE
    facts: RequestFacts                 # what the policy sees
    request_id: str                     # x-request-id, forwarded upstream
    started_s: float                    # time.perf_counter() when the request arrived (for TTFT)
    session_id: str | None              # the state store's key for the x-session-affinity session


@dataclass(slots=True)
class LegOutcome:
    response: web.StreamResponse        # what the handler returns
    endpoint_id: str | None             # where it was served (None: an error was relayed or sent)
    usage: StreamUsage                  # tokens, as counted or reported


@dataclass(slots=True)
class _Attempts:
    """One request's progress along its chain (mutable, private to a dispatch)."""
    provider_index: int = 0
    tried: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class DispatchParts:
    session: aiohttp.ClientSession      # the app's one pooled client session
    registry: UpstreamRegistry          # endpoints and their breakers
    providers: Mapping[str, Provider]   # provider implementations by provider name
    policies: Mapping[str, Policy]      # routing policy by model name
    tracker: LoadTracker                # in-flight load leases per endpoint
    prefix_index: PrefixIndex           # which endpoint caches which blocks
    retrier: Retrier                    # retries before the first byte
    store: StateStore                   # session assignments
    metrics: Metrics                    # counters and histograms
    tracing: Tracing                    # spans per decision and leg
    keepalive_s: float                  # SSE keepalive interval while the first token is awaited


class Dispatcher:
    def __init__(self, parts: DispatchParts) -> None:
        self._parts = parts

    async def dispatch(self, request: web.Request, routed: RoutedRequest) -> LegOutcome:
        attempts = _Attempts()
        client = ClientStream(request, self._parts.keepalive_s) if routed.stream else None
        try:
            return await self._parts.retrier.run(lambda: self._attempt(routed, attempts, client))
        except ClientGone:
            # The client left mid-stream; the upstream leg is already closed. aiohttp ignores the rest.
            assert client is not None and client.response is not None
            return LegOutcome(client.response, None, StreamUsage())
        except (RetryableFailure, _NothingToTry) as exc:
            error = _final_error(routed, attempts, exc)
            if client is None or not client.prepared:
                raise error from None
            await client.fail(error_event(error.message, error.error_type, str(error.code)))
            return LegOutcome(await client.finish(), None, StreamUsage())
        finally:
            if client is not None:
                await client.close()

    # --- choosing ----------------------------------------------------------------------------------

    def _choose(self, routed: RoutedRequest, attempts: _Attempts) -> tuple[Provider, Endpoint, Decision]:
        chain = routed.model.providers
        facts = routed.facts
        policy = self._parts.policies[routed.model.name]
        matched = self._parts.prefix_index.matched_blocks(facts.block_hashes) if facts.block_hashes else {}
        for index in range(attempts.provider_index, len(chain)):
            provider_name = chain[index]
            candidates = [b for b in eligible([e.breaker for e in self._parts.registry.by_provider[provider_name]])
                          if b.endpoint_id not in attempts.tried]
            if candidates:
                decision = policy.select(facts, [self._state(b.endpoint_id, matched) for b in candidates])
                if decision is not None:
                    if index != attempts.provider_index:
                        self._parts.metrics.on_fallback(facts.model, chain[attempts.provider_index], provider_name)
                        attempts.provider_index = index
                    return self._parts.providers[provider_name], self._parts.registry.endpoints[decision.endpoint_id], decision
            attempts.log.append(f"{provider_name}: no eligible endpoint left")
        raise _NothingToTry()

    def _state(self, endpoint_id: str, matched: Mapping[str, int]) -> EndpointState:
        endpoint = self._parts.registry.endpoints[endpoint_id]
        num_requests, num_prefill, num_decode = self._parts.tracker.snapshot(endpoint_id)
        return EndpointState(endpoint_id, endpoint.healthy, num_requests, num_prefill, num_decode,
                             matched.get(endpoint_id, 0),
                             self._parts.tracker.kv_free_fraction(endpoint_id))

    # --- one leg -----------------------------------------------------------------------------------

    async def _attempt(self, routed: RoutedRequest, attempts: _Attempts,
                       client: ClientStream | None) -> LegOutcome:
        with self._parts.tracing.span("routing_decision"):
            provider, endpoint, decision = self._choose(routed, attempts)
        if attempts.tried:
            self._parts.metrics.on_retry(routed.facts.model)
        attempts.tried.add(endpoint.endpoint_id)
        self._parts.metrics.on_decision(routed.facts.model, decision.reason.value)
        if routed.session_id is not None and decision.endpoint_id != routed.facts.session_endpoint:
            # Recorded before the leg starts, so concurrent turns of the session (on any replica) agree.
            await self._parts.store.set_session(routed.session_id, decision.endpoint_id, routed.model.session_ttl_s)
            if decision.session_moved_from is not None:
                self._parts.metrics.on_session_move(routed.facts.model)
                log.info("session %s moved %s -> %s", routed.facts.session_key, decision.session_moved_from,
                         decision.endpoint_id)
        headers = {REQUEST_ID_HEADER: routed.request_id}
        with self._parts.tracing.span("upstream_attempt") as span:
            if span is not None:
                span.set_attribute("switchyard.endpoint", endpoint.endpoint_id)
                span.set_attribute("switchyard.provider", provider.config.name)
                span.set_attribute("switchyard.decision", decision.reason.value)
                self._parts.tracing.inject_headers(headers)
            leg = LegRequest(routed.api_path, routed.body, routed.stream, headers)
            try:
                return await self._leg(routed, provider, endpoint, leg, client)
            except RetryableFailure as failure:
                attempts.log.append(f"{provider.config.name}@{endpoint.endpoint_id}: {failure.description}")
                if failure.retry_after_s is not None:
                    attempts.retry_after_s = failure.retry_after_s
                self._parts.metrics.on_upstream_error(provider.config.name, failure.description.split(":")[0])
                if client is not None:
                    client.arm_keepalive()
                raise
            finally:
                self._parts.policies[routed.model.name].on_request_end(endpoint.endpoint_id)

    async def _leg(self, routed: RoutedRequest, provider: Provider, endpoint: Endpoint, leg: LegRequest,
                   client: ClientStream | None) -> LegOutcome:
        breaker = endpoint.breaker
        breaker.on_attempt()
        facts = routed.facts
        started = time.perf_counter()
        body = provider.encode_body(routed.body, routed.raw)
        with self._parts.tracker.lease(endpoint.endpoint_id, facts.num_prompt_tokens,
                                 facts.num_expected_output_tokens) as lease:
            try:
                async with asyncio.timeout(provider.config.timeouts.first_byte_s) as first_byte_deadline:
                    async with provider.open(self._parts.session, endpoint.endpoint_id, leg, body) as response:
                        if response.status != 200:
                            return await self._non_200(response, breaker, client)
                        if client is None:
                            outcome = await self._relay_whole(response, endpoint)
                            breaker.on_success()
                            self._parts.metrics.observe_upstream(provider.config.name, time.perf_counter() - started)
                            return outcome
                        first = await response.content.readany()
                        if not first:
                            raise RetryableFailure("empty response: upstream closed before the first byte")
                        first_byte_deadline.reschedule(None)
                        lease.prefill_done()
                        outcome = await self._relay_stream(routed, response, first, client, lease, endpoint)
            except ClientGone:
                raise
            except TimeoutError:
                breaker.on_failure()
                raise RetryableFailure("timeout: no first byte within "
                                       f"{provider.config.timeouts.first_byte_s}s") from None
            except _CONNECT_ERRORS as exc:
                breaker.on_failure()
                raise RetryableFailure(f"connection error: {type(exc).__name__}") from None
        self._parts.metrics.observe_upstream(provider.config.name, time.perf_counter() - started)
        return outcome

    async def _non_200(self, response: aiohttp.ClientResponse, breaker: CircuitBreaker,
                       client: ClientStream | None) -> LegOutcome:
        status = response.status
        body = await response.content.read(_MAX_ERROR_BODY)
        if status == 429 or status >= 500:
            breaker.on_failure()
            raise RetryableFailure(f"HTTP {status}: {_error_message(body)}",
                                   retry_after_s=_retry_after_s(response.headers.get("Retry-After")))
        breaker.on_success()  # a client error is the client's problem: relay it as it is
        if client is not None and client.prepared:
            await client.fail(b"data: " + body.replace(b"\n", b" ") + b"\n\n")
            return LegOutcome(await client.finish(), None, StreamUsage())
        relayed = web.Response(status=status, body=body,
                               content_type=response.content_type or "application/json")
        return LegOutcome(relayed, None, StreamUsage())

    async def _relay_whole(self, response: aiohttp.ClientResponse, endpoint: Endpoint) -> LegOutcome:
        body = await response.read()
        usage = StreamUsage()
        try:
            payload = orjson.loads(body)
            if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
                apply_usage(usage, payload["usage"])
        except orjson.JSONDecodeError:
            pass
        relayed = web.Response(body=body, content_type=response.content_type or "application/json")
        return LegOutcome(relayed, endpoint.endpoint_id, usage)

    async def _relay_stream(self, routed: RoutedRequest, response: aiohttp.ClientResponse, first: bytes,
                            client: ClientStream, lease: Lease, endpoint: Endpoint) -> LegOutcome:
        counter = SseCounter()
        lease.on_output_tokens(counter.feed(first))
        await client.send_first(first, response.headers.get("Content-Type", "text/event-stream"))
        self._parts.metrics.observe_ttft(routed.facts.model, time.perf_counter() - routed.started_s)
        content = response.content
        try:
            while chunk := await content.readany():
                num_new = counter.feed(chunk)
                if num_new:
                    lease.on_output_tokens(num_new)
                await client.send(chunk)
        except ClientGone:
            raise
        except (TimeoutError, *_CONNECT_ERRORS) as exc:
            # After the first byte nothing can be retried: end the stream with an error event.
            endpoint.breaker.on_failure()
            self._parts.metrics.on_stream_error(routed.facts.model)
            log.warning("upstream %s failed mid-stream: %r", endpoint.endpoint_id, exc)
            await client.fail(error_event(f"upstream {endpoint.endpoint_id} failed mid-stream: "
                                          f"{type(exc).__name__}"), mid_event=counter.mid_event)
            return LegOutcome(await client.finish(), endpoint.endpoint_id, counter.usage)
        endpoint.breaker.on_success()
        return LegOutcome(await client.finish(), endpoint.endpoint_id, counter.usage)


class _NothingToTry(Exception):
    """No candidate endpoint is left in any provider of the chain."""


def _final_error(routed: RoutedRequest, attempts: _Attempts, exc: Exception) -> GatewayError:
    tried = "; ".join(attempts.log) or "nothing"
    headers = {}
    if attempts.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(attempts.retry_after_s)))
    if attempts.tried:
        return UpstreamsFailed(f"all upstreams failed for model {routed.facts.model!r}; tried: {tried}",
                               headers=headers)
    return NoUpstreamAvailable(f"no upstream available for model {routed.facts.model!r}: {tried}", headers=headers)


def _error_message(body: bytes) -> str:
    try:
        payload = orjson.loads(body)
        message = payload["error"]["message"]
        return str(message)[:200]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def _retry_after_s(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
