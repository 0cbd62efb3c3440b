"""What a provider drives its legs with (`Legs`): choose an endpoint in a pool, send one leg under a load
lease, its breaker and the first-byte deadline, and relay a whole answer to the client, or a streamed one
through gateway/upstream/relay.py; `leg_body`, the client's body as a provider's endpoints take it (a
continuation's from mid_stream_resume.py).

It never walks the provider chain or retries (dispatch.py does) and never builds a provider's own wire body
(a prefill or decode leg's: the P/D providers do).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple, TypeVar, cast

import aiohttp
import orjson
from aiohttp import web

from cache.prefix_index import PrefixIndex
from cache.tier_runs import NO_MATCH, MatchedByMedium, PromptTiers
from gateway.config.gateway_config import Pool, ProviderConfig
from gateway.routing.endpoints import CircuitBreaker, Endpoint, UpstreamRegistry, eligible
from gateway.routing.live_pools import LivePools
from gateway.routing.load import Lease, LoadTracker, prefill_work_tokens
from gateway.server.client_stream import ClientGone, ClientStream, StreamUsage, apply_usage
from gateway.state import StateStore
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import REQUEST_ID_HEADER, Tracing
from gateway.upstream.deadlines import TaskDeadline
from gateway.upstream.http_client import UpstreamClient
from gateway.upstream.mid_stream_resume import continuation_body
from gateway.upstream.relay import CONNECT_ERRORS, relay_stream
from gateway.upstream.request import (
    Leg,
    Outcome,
    Progress,
    ProviderExhausted,
    RetryableFailure,
    Wire,
    asks_token_ids,
)
from gateway.upstream.so_far import SoFar
from policies.base import Decision, EndpointState, Policy
from policies.fleet_view import FleetPolicy, run_of

log = logging.getLogger(__name__)

_NOTIFY_TIMEOUT_S = 5.0   # a `notify` post's whole exchange

T = TypeVar("T")
MAX_ERROR_BODY = 64 * 1024
UNSUPPORTED_PARAMETER = "unsupported_parameter"   # an upstream's 400 code for a field it cannot honour (OpenAI's)

# Reads one leg's upstream response: (response, the first-byte deadline, the leg's lease) -> the result.
ResponseReader = Callable[[aiohttp.ClientResponse, TaskDeadline, Lease], Awaitable[T]]


class Chosen(NamedTuple):
    endpoint: Endpoint
    decision: Decision
    prefill_work: int    # its lease's prefill work: gateway.routing.load.prefill_work_tokens of the prompt there


class Legs:
    """The gateway's upstream side as providers see it; one per app."""

    def __init__(self, session: aiohttp.ClientSession, registry: UpstreamRegistry, tracker: LoadTracker,
                 prefix_index: PrefixIndex, store: StateStore, metrics: Metrics, tracing: Tracing,
                 max_retry_after_s: float, on_routed: Callable[[str, Sequence[int]], None] | None = None) -> None:
        self._client = UpstreamClient(session)  # plain http endpoints; https through `session`
        self._session = session
        self._notes: set[asyncio.Task[None]] = set()   # `notify`'s posts in flight
        self._max_retry_after_s = max_retry_after_s   # an endpoint's Retry-After holds it off up to this
        self._registry = registry
        self._tracker = tracker
        self._prefix_index = prefix_index
        self.live_pools = LivePools(registry, tracker, prefix_index)   # large pools, without listing them
        self._takes_fleet: dict[type, bool] = {}   # policy class -> it has `select_fleet` (FleetPolicy)
        self._on_routed = on_routed   # an approximate endpoint's decision, for peer processes (prefix_share.py)
        self._store = store
        self.metrics = metrics
        self.tracing = tracing

    def close(self) -> None:
        """Close the pooled upstream connections (app cleanup)."""
        self._client.close()

    def notify(self, wire: Wire, url: str, body: Mapping[str, Any]) -> None:
        """POST `body` to `url` in the background: a hint the upstream may act on (a KV hold to free), which
        nothing waits for; a failure is logged at debug and changes nothing."""
        task = asyncio.get_running_loop().create_task(self._notify(wire, url, body))
        self._notes.add(task)
        task.add_done_callback(self._notes.discard)

    async def _notify(self, wire: Wire, url: str, body: Mapping[str, Any]) -> None:
        try:
            async with self._session.post(url, data=orjson.dumps(body), headers=wire.headers,
                                          timeout=aiohttp.ClientTimeout(total=_NOTIFY_TIMEOUT_S)) as response:
                await response.read()
                if response.status != 200:
                    log.debug("POST %s: HTTP %d", url, response.status)
        except (TimeoutError, *CONNECT_ERRORS) as exc:
            log.debug("POST %s failed: %r", url, exc)

    # --- choosing ----------------------------------------------------------------------------------

    def _candidates(self, progress: Progress, pool: Sequence[Endpoint]) -> list[CircuitBreaker]:
        return [b for b in eligible([e.breaker for e in pool]) if b.endpoint_id not in progress.tried]

    def has_candidate(self, progress: Progress, pool: Sequence[Endpoint]) -> bool:
        """Some healthy endpoint of `pool` admits traffic and was not tried: a policy would pick one."""
        endpoints = self._registry.endpoints
        return any(endpoints[b.endpoint_id].healthy for b in self._candidates(progress, pool))

    def choose(self, progress: Progress, pool: Sequence[Endpoint], policy: Policy) -> Chosen | None:
        """The policy's pick among the pool's endpoints whose circuit admits traffic, minus those tried, and
        its prefill work there (the prompt tokens it must compute, and those it reads back from its KV tiers at
        their restore fraction)."""
        facts = progress.request.facts
        with self.tracing.span("routing_decision"):
            fast = self._choose_in_view(progress, pool, policy)
            if fast is None:
                candidates = self._candidates(progress, pool)
                if not candidates:
                    return None
                matched = self._prefix_index.matched_blocks_by_medium(facts.block_hashes) if facts.block_hashes else {}
                decision = policy.select(facts, [self._state(b.endpoint_id, matched) for b in candidates])
                if decision is None:
                    return None
                fast = decision, matched.get(decision.endpoint_id, NO_MATCH)
        decision, chosen_match = fast
        prefill_work = facts.num_prompt_tokens
        if facts.block_hashes:  # approximate prefix mode: remember what went where (a no-op for precise endpoints)
            if self._prefix_index.record_routed(decision.endpoint_id, facts.block_hashes) and self._on_routed:
                self._on_routed(decision.endpoint_id, facts.block_hashes)
            prefill_work = prefill_work_tokens(chosen_match, facts.block_size, facts.num_prompt_tokens,
                                               self._tracker.restore_fractions(decision.endpoint_id))
        return Chosen(self._registry.endpoints[decision.endpoint_id], decision, prefill_work)

    def _choose_in_view(self, progress: Progress, pool: Sequence[Endpoint],
                        policy: Policy) -> tuple[Decision, MatchedByMedium] | None:
        """The policy's pick from a large pool's live view (gateway/routing/live_pools.py), without a state per
        endpoint, and its match; None: list the candidates instead (`view_for` or the policy cannot decide so)."""
        if len(pool) < self.live_pools.min_endpoints:   # small pools are listed (and live_pools.py is not entered)
            return None
        kind = type(policy)
        takes_fleet = self._takes_fleet.get(kind)
        if takes_fleet is None:   # a Protocol's isinstance costs tens of µs: asked once per policy class
            takes_fleet = self._takes_fleet[kind] = isinstance(policy, FleetPolicy)
        if not takes_fleet:
            return None
        fleet = self.live_pools.view_for(pool, progress.tried)
        if fleet is None:
            return None
        hashes = progress.request.facts.block_hashes
        if not hashes:
            decision = cast(FleetPolicy, policy).select_fleet(progress.request.facts, fleet, ())
            return None if decision is None else (decision, NO_MATCH)
        levels = self._prefix_index.lazy_levels(hashes)   # walked only if the policy reads them (prefix_aware)
        tiers = (PromptTiers(self._prefix_index, hashes, self._tracker.restore_fractions)
                 if fleet.tiered_mask & fleet.usable_mask else None)
        decision = cast(FleetPolicy, policy).select_fleet(progress.request.facts, fleet, levels, tiers)
        if decision is None:
            return None
        endpoint_id = decision.endpoint_id
        bit = fleet.bit_of[endpoint_id]
        run = run_of(bit, levels) if levels.walked else self._prefix_index.num_matched_blocks(endpoint_id, hashes)
        if bit & fleet.tiered_mask:   # its lease counts what its KV tiers hold at their restore cost
            return decision, self._prefix_index.matched_by_medium(endpoint_id, hashes, run)
        return decision, (run, 0, 0, 0)

    async def take(self, progress: Progress, provider_name: str) -> Chosen:
        """A single leg's endpoint from the provider's main pool: chosen, counted as tried (a retry if
        not the first), its decision recorded and the session pinned to it; ProviderExhausted if none."""
        chosen = self.choose(progress, self.pool(provider_name), progress.policy)
        if chosen is None:
            raise ProviderExhausted("no eligible endpoint left")
        endpoint, decision, _ = chosen
        model = progress.request.facts.model
        if progress.tried:
            self.metrics.on_retry(model)
        progress.tried.add(endpoint.endpoint_id)
        self.metrics.on_decision(model, decision.reason.value)
        await self.pin_session(progress, decision)
        return chosen

    def _state(self, endpoint_id: str, matched: Mapping[str, MatchedByMedium]) -> EndpointState:
        endpoint = self._registry.endpoints[endpoint_id]
        num_requests, num_prefill, num_decode = self._tracker.snapshot(endpoint_id)
        by_medium = matched.get(endpoint_id, NO_MATCH)
        tiers = by_medium[1:]
        fractions = self._tracker.restore_fractions(endpoint_id) if any(tiers) else (None, None, None)
        return EndpointState(endpoint_id, endpoint.healthy, num_requests, num_prefill, num_decode,
                             by_medium[0], self._tracker.kv_free_fraction(endpoint_id), tiers, fractions)

    def pool(self, provider_name: str, pool: Pool = Pool.MAIN) -> list[Endpoint]:
        """One of a provider's pools of endpoints."""
        return self._registry.pool(provider_name, pool)

    async def pin_session(self, progress: Progress, decision: Decision) -> None:
        """Record the session's endpoint before the leg starts, so concurrent turns (on any replica) agree."""
        request = progress.request
        if request.session_id is None or decision.endpoint_id == request.facts.session_endpoint:
            return
        await self._store.set_session(request.session_id, decision.endpoint_id, request.model.session_ttl_s)
        if decision.session_moved_from is not None:
            self.metrics.on_session_move(request.facts.model)
            log.info("session %s moved %s -> %s", request.facts.session_key, decision.session_moved_from,
                     decision.endpoint_id)

    def leg_headers(self, progress: Progress, span: Any, wire: Wire, endpoint_id: str,
                    decision: Decision) -> dict[str, str]:
        """The wire's headers, x-request-id and, when tracing, the span's attributes and `traceparent`."""
        headers = {**wire.headers, REQUEST_ID_HEADER: progress.request.request_id}
        if span is not None:
            span.set_attribute("switchyard.endpoint", endpoint_id)
            span.set_attribute("switchyard.provider", wire.provider_name)
            span.set_attribute("switchyard.decision", decision.reason.value)
            self.tracing.inject_headers(headers)
        return headers

    def record_failure(self, progress: Progress, provider_name: str, endpoint_id: str | None,
                       failure: RetryableFailure) -> None:
        """A failed leg of `progress` (at `endpoint_id`, None: the provider's pair of legs): logged for the
        final error, counted, keepalive re-armed."""
        progress.num_failures += 1
        progress.num_rate_limited += failure.rate_limited
        where = provider_name if endpoint_id is None else f"{provider_name}@{endpoint_id}"
        progress.log.append(f"{where}: {failure.description}")
        if failure.retry_after_s is not None:
            progress.retry_after_s = failure.retry_after_s
        self.metrics.on_upstream_error(provider_name, failure.description.split(":")[0])
        if progress.client is not None:
            progress.client.arm_keepalive()

    # --- one leg -----------------------------------------------------------------------------------

    async def send(self, progress: Progress, leg: Leg, read: ResponseReader[T]) -> T:
        """Send one leg under a lease and hand its response to `read`. Connect errors and a missed
        first-byte deadline become `RetryableFailure` (counted against the endpoint's breaker); any
        `RetryableFailure` marks the endpoint tried and is recorded in `progress`."""
        endpoint, wire = leg.endpoint, leg.wire
        endpoint.breaker.on_attempt()
        started = time.perf_counter()
        try:
            with self._tracker.lease(endpoint.endpoint_id, leg.num_prompt_tokens, leg.num_output_tokens) as lease:
                try:
                    async with self._client.deadlines.timeout(wire.first_byte_s) as first_byte_deadline, \
                            self._client.post(endpoint.endpoint_id + leg.path, data=leg.body, headers=leg.headers,
                                              timeout=wire.timeout) as response:
                        result = await read(response, first_byte_deadline, lease)
                except ClientGone:
                    raise
                except TimeoutError:
                    endpoint.breaker.on_failure()
                    raise RetryableFailure(f"timeout: no first byte within {wire.first_byte_s}s") from None
                except CONNECT_ERRORS as exc:
                    endpoint.breaker.on_failure()
                    raise RetryableFailure(f"connection error: {type(exc).__name__}") from None
        except RetryableFailure as failure:
            progress.tried.add(endpoint.endpoint_id)
            self.record_failure(progress, wire.provider_name, endpoint.endpoint_id, failure)
            raise
        self.metrics.observe_upstream(wire.provider_name, leg.kind.value, time.perf_counter() - started)
        return result

    # --- answers -----------------------------------------------------------------------------------

    async def relay(self, progress: Progress, endpoint: Endpoint, response: aiohttp.ClientResponse,
                    first_byte_deadline: TaskDeadline, lease: Lease) -> Outcome:
        """A `ResponseReader` for a leg that is the whole request: its answer goes to the client as it comes."""
        if response.status != 200:
            return await self.non_200(response, endpoint.breaker, progress.client)
        if progress.client is None:
            outcome = await self._relay_whole(response, endpoint)
            endpoint.breaker.on_success()
            return outcome
        first = await self.first_chunk(response, first_byte_deadline, lease)
        return await self.relay_stream(progress, response, first, lease, endpoint)

    async def first_chunk(self, response: aiohttp.ClientResponse, first_byte_deadline: TaskDeadline,
                          lease: Lease) -> bytes:
        """The first body bytes of a stream: from here on the leg can no longer be retried."""
        first = await response.content.readany()
        if not first:
            raise RetryableFailure("empty response: upstream closed before the first byte")
        first_byte_deadline.reschedule(None)
        lease.prefill_done()
        return first

    async def non_200(self, response: aiohttp.ClientResponse, breaker: CircuitBreaker,
                      client: ClientStream | None) -> Outcome:
        body = await response.content.read(MAX_ERROR_BODY)
        return await self.answer_error(response, body, breaker, client)

    async def answer_error(self, response: aiohttp.ClientResponse, body: bytes, breaker: CircuitBreaker,
                           client: ClientStream | None) -> Outcome:
        """429/5xx: retryable (the breaker counts it); any other status is the client's: relayed as it is."""
        status = response.status
        if status == 429 or status >= 500:
            breaker.on_failure()
            retry_after_s = _retry_after_s(response.headers.get("Retry-After"))
            if retry_after_s is not None:   # no new requests there until then; this one is retried elsewhere now
                breaker.hold_off(min(retry_after_s, self._max_retry_after_s))
            raise RetryableFailure(f"HTTP {status}: {error_message(body)}", rate_limited=status == 429,
                                   retry_after_s=retry_after_s)
        breaker.on_success()
        if status == 400 and error_code(body) == UNSUPPORTED_PARAMETER and (client is None or not client.prepared):
            # The request asks what this upstream cannot honour (our workers: tools, a JSON response_format):
            # the next provider of the chain may (a 400 naming the field where none does).
            raise ProviderExhausted(error_message(body), unsupported=error_param(body) or "")
        if client is not None and client.prepared:
            await client.fail(b"data: " + body.replace(b"\n", b" ") + b"\n\n")
            return Outcome(await client.finish(), None, StreamUsage())
        relayed = web.Response(status=status, body=body, content_type=response.content_type or "application/json")
        return Outcome(relayed, None, StreamUsage())

    async def _relay_whole(self, response: aiohttp.ClientResponse, endpoint: Endpoint) -> Outcome:
        body = await response.read()
        usage = StreamUsage()
        try:  # orjson on the whole body is as fast as scanning it for the usage key (measured)
            payload = orjson.loads(body)
            if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
                apply_usage(usage, payload["usage"])
        except orjson.JSONDecodeError:
            pass
        relayed = web.Response(body=body, content_type=response.content_type or "application/json")
        return Outcome(relayed, endpoint.endpoint_id, usage)

    async def relay_stream(self, progress: Progress, response: aiohttp.ClientResponse, first: bytes, lease: Lease,
                           endpoint: Endpoint, sent_before: bytes = b"") -> Outcome:
        """Relay SSE bytes as they arrive (gateway/upstream/relay.py)."""
        return await relay_stream(self.metrics, progress, response, first, lease, endpoint, sent_before)


def leg_body(config: ProviderConfig, body: Mapping[str, Any], raw: bytes, *, can_fail_over: bool,
             so_far: SoFar | None) -> tuple[bytes, bool] | None:
    """The body of a leg to `config`'s endpoints and whether the continuation's usage already counts the
    output so far; `raw` (the client's bytes) when nothing changes. With `can_fail_over` our workers are asked
    for token ids. For a continuation (`so_far`), mid-stream resume's body, None when this provider cannot
    continue it."""
    out: dict[str, Any] | None = None
    if config.upstream_model is not None and body.get("model") != config.upstream_model:
        out = {**body, "model": config.upstream_model}
    if can_fail_over and config.offers_token_ids and not asks_token_ids(body):
        out = {**(out or body), "return_token_ids": True}
    if so_far is None:
        return (raw, False) if out is None else (orjson.dumps(out), False)
    return continuation_body(config, dict(out or body), so_far)


def error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])[:200]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def error_code(body: bytes) -> str | None:
    """`error.code` of an OpenAI-style error body, when it has one."""
    return _error_field(body, "code")


def error_param(body: bytes) -> str | None:
    """`error.param` of an OpenAI-style error body, when it has one."""
    return _error_field(body, "param")


def _error_field(body: bytes, name: str) -> str | None:
    try:
        value = orjson.loads(body)["error"][name]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def _retry_after_s(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:   # "inf" and "1e400" are floats too: no finite wait, so no Retry-After (round() of one raised)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
