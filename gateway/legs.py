"""The building blocks providers compose into an attempt: choose an endpoint in a pool, run one upstream
leg under a load lease, its breaker and the first-byte deadline, relay a whole or streamed answer.

It never walks the provider chain or retries (dispatch.py does) and never speaks a wire format
(providers do).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from cache.prefix_index import PrefixIndex
from gateway.breaker import CircuitBreaker, eligible
from gateway.config import ModelConfig
from gateway.fallback import Retrier, RetryableFailure
from gateway.load import Lease, LoadTracker
from gateway.metrics import Metrics
from gateway.state import StateStore
from gateway.streaming import ClientGone, ClientStream, SseCounter, StreamUsage, apply_usage, error_event
from gateway.tracing import REQUEST_ID_HEADER, Tracing
from gateway.upstreams import Endpoint, UpstreamRegistry
from policies.base import Decision, EndpointState, Policy, RequestFacts

if TYPE_CHECKING:
    from gateway.providers.base import Provider

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_ERROR_BODY = 64 * 1024
CONNECT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)


class LegKind(str, Enum):
    SINGLE = "single"        # the whole request in one leg
    PREFILL = "prefill"      # disaggregated leg 1: the prompt's KV and the first token
    DECODE = "decode"        # disaggregated leg 2: the rest of the output, from the transferred KV


@dataclass(frozen=True, slots=True)
class LegRequest:
    path: str                       # API path, e.g. "/v1/chat/completions"
    body: Mapping[str, Any]         # the leg's body as parsed (the client's, or the leg's rewrite of it)
    stream: bool                    # the leg streams SSE
    headers: Mapping[str, str]      # x-request-id, traceparent: forwarded upstream


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
class Attempts:
    """One request's progress along its chain (mutable, private to a dispatch)."""
    provider_index: int = 0                                   # the provider being tried
    tried: set[str] = field(default_factory=set)              # endpoints that failed (or served) this request
    log: list[str] = field(default_factory=list)              # what was tried and why it failed
    retry_after_s: float | None = None                        # the last upstream Retry-After
    num_failures: int = 0                                     # failed legs
    scratch: dict[str, Any] = field(default_factory=dict)     # provider-private state kept across retries


@dataclass(frozen=True, slots=True)
class Job:
    routed: RoutedRequest               # the request
    attempts: Attempts                  # its progress
    client: ClientStream | None         # the SSE client (None: a non-streaming request)


class ProviderExhausted(Exception):
    """The provider has nothing (left) to try for this request: the dispatcher moves to the next one."""

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


@dataclass(frozen=True, slots=True)
class LegTarget:
    provider: Provider                  # speaks the wire format
    endpoint: Endpoint                  # where the leg goes
    kind: LegKind                       # for metrics
    leg: LegRequest                     # path, parsed body, headers
    body: bytes                         # the encoded upstream body
    num_prompt_tokens: int              # the lease's prefill tokens
    num_output_tokens: int              # the lease's decode tokens


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


ResponseHandler = Callable[[aiohttp.ClientResponse, asyncio.Timeout, Lease], Awaitable[T]]


class LegRunner:
    def __init__(self, parts: DispatchParts) -> None:
        self.parts = parts

    # --- choosing ----------------------------------------------------------------------------------

    def choose(self, job: Job, pool: Sequence[Endpoint], policy: Policy) -> tuple[Endpoint, Decision] | None:
        """The policy's pick among the pool's endpoints whose circuit admits traffic, minus those tried."""
        facts = job.routed.facts
        with self.parts.tracing.span("routing_decision"):
            candidates = [b for b in eligible([e.breaker for e in pool]) if b.endpoint_id not in job.attempts.tried]
            if not candidates:
                return None
            matched = self.parts.prefix_index.matched_blocks(facts.block_hashes) if facts.block_hashes else {}
            decision = policy.select(facts, [self._state(b.endpoint_id, matched) for b in candidates])
        if decision is None:
            return None
        return self.parts.registry.endpoints[decision.endpoint_id], decision

    def _state(self, endpoint_id: str, matched: Mapping[str, int]) -> EndpointState:
        endpoint = self.parts.registry.endpoints[endpoint_id]
        num_requests, num_prefill, num_decode = self.parts.tracker.snapshot(endpoint_id)
        return EndpointState(endpoint_id, endpoint.healthy, num_requests, num_prefill, num_decode,
                             matched.get(endpoint_id, 0), self.parts.tracker.kv_free_fraction(endpoint_id))

    def leg_headers(self, job: Job, span: Any, provider_name: str, endpoint_id: str, decision: Decision) -> dict[str, str]:
        """x-request-id and, when tracing, the span's attributes and `traceparent`."""
        headers = {REQUEST_ID_HEADER: job.routed.request_id}
        if span is not None:
            span.set_attribute("switchyard.endpoint", endpoint_id)
            span.set_attribute("switchyard.provider", provider_name)
            span.set_attribute("switchyard.decision", decision.reason.value)
            self.parts.tracing.inject_headers(headers)
        return headers

    def record_failure(self, job: Job, provider_name: str, endpoint_id: str, failure: RetryableFailure) -> None:
        attempts = job.attempts
        attempts.num_failures += 1
        attempts.log.append(f"{provider_name}@{endpoint_id}: {failure.description}")
        if failure.retry_after_s is not None:
            attempts.retry_after_s = failure.retry_after_s
        self.parts.metrics.on_upstream_error(provider_name, failure.description.split(":")[0])
        if job.client is not None:
            job.client.arm_keepalive()

    # --- one leg -----------------------------------------------------------------------------------

    async def run(self, target: LegTarget, on_response: ResponseHandler[T]) -> T:
        """Send one leg under a lease; connect errors and a missed first-byte deadline become
        `RetryableFailure` (and count against the endpoint's breaker)."""
        endpoint, timeouts = target.endpoint, target.provider.config.timeouts
        endpoint.breaker.on_attempt()
        started = time.perf_counter()
        with self.parts.tracker.lease(endpoint.endpoint_id, target.num_prompt_tokens, target.num_output_tokens) as lease:
            try:
                async with asyncio.timeout(timeouts.first_byte_s) as first_byte_deadline:
                    async with target.provider.open(self.parts.session, endpoint.endpoint_id, target.leg,
                                                    target.body) as response:
                        result = await on_response(response, first_byte_deadline, lease)
            except ClientGone:
                raise
            except TimeoutError:
                endpoint.breaker.on_failure()
                raise RetryableFailure(f"timeout: no first byte within {timeouts.first_byte_s}s") from None
            except CONNECT_ERRORS as exc:
                endpoint.breaker.on_failure()
                raise RetryableFailure(f"connection error: {type(exc).__name__}") from None
        self.parts.metrics.observe_upstream(target.provider.config.name, target.kind.value,
                                            time.perf_counter() - started)
        return result

    async def run_routed(self, job: Job, target: LegTarget, on_response: ResponseHandler[T], policy: Policy) -> T:
        """`run`, plus what every routed leg owes the request: a failure marks the endpoint tried and is
        recorded; the policy always hears that the request left the endpoint."""
        endpoint_id = target.endpoint.endpoint_id
        try:
            return await self.run(target, on_response)
        except RetryableFailure as failure:
            job.attempts.tried.add(endpoint_id)
            self.record_failure(job, target.provider.config.name, endpoint_id, failure)
            raise
        finally:
            policy.on_request_end(endpoint_id)

    async def single_leg(self, job: Job, provider: Provider, endpoint: Endpoint, decision: Decision,
                         policy: Policy) -> LegOutcome:
        """The whole request as one leg to `endpoint`, relayed to the client as it comes."""
        routed, attempts, metrics = job.routed, job.attempts, self.parts.metrics
        if attempts.tried:
            metrics.on_retry(routed.facts.model)
        attempts.tried.add(endpoint.endpoint_id)
        metrics.on_decision(routed.facts.model, decision.reason.value)
        if routed.session_id is not None and decision.endpoint_id != routed.facts.session_endpoint:
            # Recorded before the leg starts, so concurrent turns of the session (on any replica) agree.
            await self.parts.store.set_session(routed.session_id, decision.endpoint_id, routed.model.session_ttl_s)
            if decision.session_moved_from is not None:
                metrics.on_session_move(routed.facts.model)
                log.info("session %s moved %s -> %s", routed.facts.session_key, decision.session_moved_from,
                         decision.endpoint_id)
        with self.parts.tracing.span("upstream_attempt") as span:
            headers = self.leg_headers(job, span, provider.config.name, endpoint.endpoint_id, decision)
            target = LegTarget(provider, endpoint, LegKind.SINGLE,
                               LegRequest(routed.api_path, routed.body, routed.stream, headers),
                               provider.encode_body(routed.body, routed.raw),
                               routed.facts.num_prompt_tokens, routed.facts.num_expected_output_tokens)
            return await self.run_routed(job, target, partial(self._single_answer, job, endpoint), policy)

    async def _single_answer(self, job: Job, endpoint: Endpoint, response: aiohttp.ClientResponse,
                             first_byte_deadline: asyncio.Timeout, lease: Lease) -> LegOutcome:
        if response.status != 200:
            return await self.non_200(response, endpoint.breaker, job.client)
        if job.client is None:
            outcome = await self._relay_whole(response, endpoint)
            endpoint.breaker.on_success()
            return outcome
        first = await self.first_chunk(response, first_byte_deadline, lease)
        return await self.relay_stream(job, response, first, lease, endpoint)

    async def first_chunk(self, response: aiohttp.ClientResponse, first_byte_deadline: asyncio.Timeout,
                          lease: Lease) -> bytes:
        """The first body bytes of a stream: from here on the leg can no longer be retried."""
        first = await response.content.readany()
        if not first:
            raise RetryableFailure("empty response: upstream closed before the first byte")
        first_byte_deadline.reschedule(None)
        lease.prefill_done()
        return first

    # --- answers -----------------------------------------------------------------------------------

    async def non_200(self, response: aiohttp.ClientResponse, breaker: CircuitBreaker,
                      client: ClientStream | None) -> LegOutcome:
        body = await response.content.read(MAX_ERROR_BODY)
        return await self.answer_error(response, body, breaker, client)

    async def answer_error(self, response: aiohttp.ClientResponse, body: bytes, breaker: CircuitBreaker,
                           client: ClientStream | None) -> LegOutcome:
        """429/5xx: retryable (the breaker counts it); any other status is the client's: relayed as it is."""
        status = response.status
        if status == 429 or status >= 500:
            breaker.on_failure()
            raise RetryableFailure(f"HTTP {status}: {error_message(body)}",
                                   retry_after_s=_retry_after_s(response.headers.get("Retry-After")))
        breaker.on_success()
        if client is not None and client.prepared:
            await client.fail(b"data: " + body.replace(b"\n", b" ") + b"\n\n")
            return LegOutcome(await client.finish(), None, StreamUsage())
        relayed = web.Response(status=status, body=body, content_type=response.content_type or "application/json")
        return LegOutcome(relayed, None, StreamUsage())

    async def _relay_whole(self, response: aiohttp.ClientResponse, endpoint: Endpoint) -> LegOutcome:
        body = await response.read()
        usage = StreamUsage()
        try:  # orjson on the whole body is as fast as scanning it for the usage key (measured)
            payload = orjson.loads(body)
            if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
                apply_usage(usage, payload["usage"])
        except orjson.JSONDecodeError:
            pass
        relayed = web.Response(body=body, content_type=response.content_type or "application/json")
        return LegOutcome(relayed, endpoint.endpoint_id, usage)

    async def relay_stream(self, job: Job, response: aiohttp.ClientResponse, first: bytes, lease: Lease,
                           endpoint: Endpoint) -> LegOutcome:
        """Relay SSE bytes as they arrive; after the first byte a failure ends the stream with an error event."""
        client, model = job.client, job.routed.facts.model
        assert client is not None
        counter = SseCounter()
        lease.on_output_tokens(counter.feed(first))
        is_first_data = not client.data_started
        await client.send_first(first, response.headers.get("Content-Type", "text/event-stream"))
        if is_first_data:
            self.parts.metrics.observe_ttft(model, time.perf_counter() - job.routed.started_s)
        write = client.writer()
        try:
            while chunk := await response.content.readany():
                num_new = counter.feed(chunk)
                if num_new:
                    lease.on_output_tokens(num_new)
                try:
                    await write(chunk)  # `client.send` without a coroutine per chunk
                except ConnectionResetError as exc:
                    raise ClientGone() from exc
        except ClientGone:
            raise
        except (TimeoutError, *CONNECT_ERRORS) as exc:
            endpoint.breaker.on_failure()
            self.parts.metrics.on_stream_error(model)
            log.warning("upstream %s failed mid-stream: %r", endpoint.endpoint_id, exc)
            await client.fail(error_event(f"upstream {endpoint.endpoint_id} failed mid-stream: "
                                          f"{type(exc).__name__}"), mid_event=counter.mid_event)
            return LegOutcome(await client.finish(), endpoint.endpoint_id, counter.usage)
        endpoint.breaker.on_success()
        return LegOutcome(await client.finish(), endpoint.endpoint_id, counter.usage)


def error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])[:200]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def error_code(body: bytes) -> str | None:
    """`error.code` of an OpenAI-style error body, when it has one."""
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


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
