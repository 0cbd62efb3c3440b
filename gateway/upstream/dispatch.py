"""Walks a request along its model's provider chain: each provider serves it with its own legs (one, or
prefill then decode); failures before the first byte are retried with backoff and a budget; when a
provider has nothing left, the next one in the chain is tried. A stream whose upstream fails after the
client has part of it is continued elsewhere, along the chain again (gateway/upstream/mid_stream_resume.py).

It never parses client input (the API handlers do), never decides scores (the policies do) and
never speaks a wire format (the providers do).

Retries come before the first byte only: tenacity backoff with jitter, and a retry budget so that retries
cannot multiply an outage (`Retrier`, `RetryBudget`, at the end). A retry never goes back to an endpoint this
request tried, so an upstream's Retry-After does not delay it: the endpoint that sent one is held off for new
requests instead (legs.py, `CircuitBreaker.hold_off`). The first attempt runs without tenacity (the hot path
pays nothing); only after a retryable failure does a tenacity loop take over.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from aiohttp import web
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, stop_any
from tenacity.stop import stop_base
from tenacity.wait import wait_exponential_jitter

from gateway.config.gateway_config import RetryConfig
from gateway.errors import BadRequest, GatewayError, NoUpstreamAvailable, UpstreamsFailed, UpstreamsRateLimited
from gateway.server.client_stream import DONE_EVENT, ClientStream, SseResponseFactory, StreamUsage, error_event
from gateway.telemetry.metrics import Metrics
from gateway.upstream.legs import Legs
from gateway.upstream.mid_stream_resume import StreamBroken, answered_so_far
from gateway.upstream.providers import Provider, ProviderRun
from gateway.upstream.request import (
    Outcome,
    Progress,
    ProviderExhausted,
    RetryableFailure,
    RoutedRequest,
    num_sequences,
)
from policies.base import Policy

log = logging.getLogger(__name__)

T = TypeVar("T")


class Dispatcher:
    def __init__(self, legs: Legs, providers: Mapping[str, Provider], policies: Mapping[str, Policy],
                 retrier: Retrier, metrics: Metrics, keepalive_s: float) -> None:
        self.legs = legs
        self.providers = providers      # by provider name
        self._policies = policies       # by model name
        self._retrier = retrier
        self.metrics = metrics
        self._keepalive_s = keepalive_s   # SSE keepalive interval while the first token is awaited

    def client_stream(self, request: web.Request, sse_response: SseResponseFactory | None = None) -> ClientStream:
        """The client's side of a streamed answer (`sse_response`: how its response is built; None: OpenAI's
        SSE as relayed). The caller owns it: after `dispatch`, however it ends, it reads what the client got."""
        return ClientStream(request, self._keepalive_s, sse_response)

    async def dispatch(self, routed: RoutedRequest, client: ClientStream | None) -> Outcome:
        """Serve `routed`, streamed to `client` (None: not streamed). Raises `ClientGone` when the client
        closed its connection mid-stream (the upstream leg is already closed)."""
        progress = Progress(routed, client, self._policies[routed.model.name],
                            can_fail_over=_can_fail_over(routed, client))
        try:
            while True:
                walk = _ChainWalk(self, progress)
                try:
                    return await self._retrier.run(walk)
                except StreamBroken as broken:
                    assert client is not None
                    ended = await self._continue_or_end(progress, client, broken)
                    if ended is not None:
                        return ended
        except (RetryableFailure, _NothingToTry) as exc:
            walk.give_up()
            error = _final_error(progress, exc)
            if client is None or not client.prepared:
                raise error from None
            if progress.so_far is not None:     # a broken stream found nowhere to go on
                self.metrics.on_failover(routed.model.name, "failed")
                self.metrics.on_stream_error(routed.model.name)
            await client.fail(error_event(error.message, error.error_type, str(error.code)))
            return Outcome(await client.finish(), None, StreamUsage())

    async def _continue_or_end(self, progress: Progress, client: ClientStream, broken: StreamBroken) -> Outcome | None:
        """After `broken`: None when the answer is to go on elsewhere (`progress` now says what the client
        has); else the stream ended, whole or with an error event."""
        request = progress.request
        model = request.facts.model
        progress.tried.add(broken.endpoint_id)
        progress.log.append(f"{broken.endpoint_id}: failed mid-stream: {broken.description}")
        leg = answered_so_far(broken.transcript, chat=request.api_path.endswith("chat/completions"),
                              num_choices=num_sequences(request.body))
        if leg is not None and progress.stitch is not None:   # a continuation's leg: at the client's indices
            leg = progress.stitch.read_back(leg)
        so_far = leg if progress.so_far is None or leg is None else progress.so_far.then(leg)
        if so_far is not None and so_far.finished:   # it broke after its last token: nothing is missing
            await client.send(DONE_EVENT)
            return Outcome(await client.finish(), broken.endpoint_id, broken.usage)
        if so_far is not None and self._retrier.try_spend():
            log.warning("request %s: upstream %s failed mid-stream after %d tokens; continuing elsewhere",
                        request.request_id, broken.endpoint_id, so_far.num_tokens)
            progress.so_far = so_far
            client.arm_keepalive()
            return None
        self.metrics.on_failover(model, "not_continuable" if so_far is None else "no_budget")
        self.metrics.on_stream_error(model)
        await client.fail(error_event(f"upstream {broken.endpoint_id} failed mid-stream: {broken.description}"))
        return Outcome(await client.finish(), broken.endpoint_id, broken.usage)


def _can_fail_over(routed: RoutedRequest, client: ClientStream | None) -> bool:
    """A stream, for a model that allows failover: each of its choices goes on from its own output (whether a
    provider can continue it is `leg_body`'s). A stream re-encoded for another API (POST /v1/messages) fails
    over too: the continuation's chunks feed the same translation."""
    return client is not None and routed.model.mid_stream_failover


class _ChainWalk:
    """One request's walk along its chain; each call is one try: the current provider, or the next
    ones when it has nothing left."""

    __slots__ = ("_dispatcher", "_index", "_progress", "_run", "_unsupported")

    def __init__(self, dispatcher: Dispatcher, progress: Progress) -> None:
        self._dispatcher = dispatcher
        self._progress = progress
        self._index = 0                         # the provider being tried
        self._run: ProviderRun | None = None    # its run for this request, once started
        self._unsupported: list[str | None] = []   # each exhausted provider's `ProviderExhausted.unsupported`

    async def __call__(self) -> Outcome:
        dispatcher, progress = self._dispatcher, self._progress
        chain = progress.request.model.providers
        while self._index < len(chain):
            name = chain[self._index]
            if self._run is None:
                self._run = dispatcher.providers[name].start(progress, dispatcher.legs)
            try:
                return await self._run()
            except RetryableFailure:
                if not self._anything_left(chain):
                    raise _NothingToTry() from None   # no backoff or Retry-After wait before a retry with no endpoint
                raise
            except ProviderExhausted as exc:
                progress.log.append(f"{name}: {exc.description}")
                if progress.client_has_data:
                    raise _NothingToTry() from None  # the client has part of an answer: no other provider
                self._unsupported.append(exc.unsupported)
            self._index += 1
            self._run = None
            if self._index < len(chain):
                dispatcher.metrics.on_fallback(progress.request.facts.model, name, chain[self._index])
        unsupported = len(self._unsupported) == len(chain) and None not in self._unsupported
        raise _NothingToTry(next((p for p in self._unsupported if p), "") if unsupported else None)

    def give_up(self) -> None:
        """The request ends unserved with this walk's run current: a run that holds something upstream for a
        later try (a disaggregated run's held prefill) lets it go (`abandon`)."""
        abandon = getattr(self._run, "abandon", None)
        if abandon is not None:
            abandon()

    def _anything_left(self, chain: tuple[str, ...]) -> bool:
        """Some provider from the current one on has an endpoint a retry could use (a disaggregated one may
        have more: its other pool is not looked at, so this errs towards waiting and retrying)."""
        legs, progress = self._dispatcher.legs, self._progress
        return any(legs.has_candidate(progress, legs.pool(name)) for name in chain[self._index:])


class _NothingToTry(Exception):
    """No candidate endpoint is left in any provider of the chain. `unsupported`: every provider refused the
    request itself (the field to blame, or ""); None otherwise."""

    def __init__(self, unsupported: str | None = None) -> None:
        super().__init__()
        self.unsupported = unsupported


def _final_error(progress: Progress, exc: Exception) -> GatewayError:
    model, tried = progress.request.facts.model, "; ".join(progress.log) or "nothing"
    headers = {}
    if progress.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(progress.retry_after_s)))
    if progress.num_failures and progress.num_rate_limited == progress.num_failures:
        return UpstreamsRateLimited(f"every upstream for model {model!r} is rate limiting; tried: {tried}",
                                    headers=headers)
    if isinstance(exc, _NothingToTry) and exc.unsupported is not None and not progress.num_failures:
        return BadRequest(f"model {model!r} cannot serve this request: {tried}", param=exc.unsupported or None)
    if progress.tried or progress.num_failures:
        return UpstreamsFailed(f"all upstreams failed for model {model!r}; tried: {tried}", headers=headers)
    return NoUpstreamAvailable(f"no upstream available for model {model!r}: {tried}", headers=headers)


class RetryBudget:
    """Retries may be at most `ratio` x requests (+ a minimum) over a sliding window, so retries
    cannot multiply an outage. Per-second buckets; the clock is injectable for tests."""

    def __init__(self, config: RetryConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._ratio = config.budget_ratio
        self._min = config.budget_min_retries
        self._num_buckets = max(1, int(config.budget_window_s))
        self._clock = clock
        self._requests = [0] * self._num_buckets
        self._retries = [0] * self._num_buckets
        self._epoch = int(clock())

    def _advance(self) -> int:
        now = int(self._clock())
        if now - self._epoch >= self._num_buckets:
            self._requests = [0] * self._num_buckets
            self._retries = [0] * self._num_buckets
        else:
            for second in range(self._epoch + 1, now + 1):
                self._requests[second % self._num_buckets] = 0
                self._retries[second % self._num_buckets] = 0
        self._epoch = max(self._epoch, now)
        return now % self._num_buckets

    def on_request(self) -> None:
        self._requests[self._advance()] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        index = self._advance()
        if sum(self._retries) >= self._min + self._ratio * sum(self._requests):
            return False
        self._retries[index] += 1
        return True


class _StopWhenBudgetSpent(stop_base):
    """Stops retrying when the budget refuses one more retry (each call spends one if it can)."""

    def __init__(self, budget: RetryBudget) -> None:
        self._budget = budget

    def __call__(self, retry_state: RetryCallState) -> bool:
        return not self._budget.try_spend()


class Retrier:
    """Runs an attempt function until it succeeds, the attempts or the budget run out."""

    def __init__(self, config: RetryConfig, budget: RetryBudget) -> None:
        self._budget = budget
        self._template = AsyncRetrying(
            stop=stop_any(stop_after_attempt(config.max_attempts), _StopWhenBudgetSpent(budget)),
            wait=wait_exponential_jitter(max=config.backoff_max_s, jitter=config.backoff_jitter_s,
                                         multiplier=config.backoff_initial_s),
            retry=retry_if_exception_type(RetryableFailure),
            sleep=asyncio.sleep,
            reraise=True,
        )

    def try_spend(self) -> bool:
        """Take one retry from the budget outside `run` (a stream continued after its upstream failed)."""
        return self._budget.try_spend()

    async def run(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Raises the last RetryableFailure when every allowed attempt failed."""
        self._budget.on_request()
        try:
            return await attempt()
        except RetryableFailure as failure:
            first: list[RetryableFailure] = [failure]

        async def replay_then_attempt() -> T:
            # tenacity sees the fast-path failure as its attempt 1, so counts and waits stay right.
            if first:
                raise first.pop()
            return await attempt()

        return await self._template.copy()(replay_then_attempt)
