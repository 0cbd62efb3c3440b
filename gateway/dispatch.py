"""Walks a request along its model's provider chain: each provider makes an attempt (one leg, or prefill
then decode) with the building blocks in legs.py; failures before the first byte are retried with
backoff and a budget; when a provider has nothing left, the next one in the chain is tried.

It never parses client input (the API handlers do), never decides scores (the policies do) and
never speaks a wire format (the providers do).
"""
from __future__ import annotations

from aiohttp import web

from gateway.errors import GatewayError, NoUpstreamAvailable, UpstreamsFailed
from gateway.fallback import RetryableFailure
from gateway.legs import (Attempts, DispatchParts, Job, LegOutcome, LegRunner, ProviderExhausted,
                          RoutedRequest)
from gateway.streaming import ClientGone, ClientStream, StreamUsage, error_event

__all__ = ["DispatchParts", "Dispatcher", "LegOutcome", "RoutedRequest"]


class Dispatcher:
    def __init__(self, parts: DispatchParts) -> None:
        self._parts = parts
        self._legs = LegRunner(parts)

    async def dispatch(self, request: web.Request, routed: RoutedRequest) -> LegOutcome:
        client = ClientStream(request, self._parts.keepalive_s) if routed.stream else None
        job = Job(routed, Attempts(), client)
        try:
            return await self._parts.retrier.run(lambda: self._attempt(job))
        except ClientGone:
            # The client left mid-stream; the upstream leg is already closed. aiohttp ignores the rest.
            assert client is not None and client.response is not None
            return LegOutcome(client.response, None, StreamUsage())
        except (RetryableFailure, _NothingToTry) as exc:
            error = _final_error(routed, job.attempts, exc)
            if client is None or not client.prepared:
                raise error from None
            await client.fail(error_event(error.message, error.error_type, str(error.code)))
            return LegOutcome(await client.finish(), None, StreamUsage())
        finally:
            if client is not None:
                await client.close()

    async def _attempt(self, job: Job) -> LegOutcome:
        """One try: the current provider, or the next ones in the chain when it has nothing left."""
        chain, attempts = job.routed.model.providers, job.attempts
        for index in range(attempts.provider_index, len(chain)):
            name = chain[index]
            if index != attempts.provider_index:
                self._parts.metrics.on_fallback(job.routed.facts.model, chain[attempts.provider_index], name)
                attempts.provider_index = index
            try:
                return await self._parts.providers[name].attempt(self._legs, job)
            except ProviderExhausted as exc:
                attempts.log.append(f"{name}: {exc.description}")
                if job.client is not None and job.client.data_started:
                    raise _NothingToTry() from None  # the client has part of an answer: no other provider
        raise _NothingToTry()


class _NothingToTry(Exception):
    """No candidate endpoint is left in any provider of the chain."""


def _final_error(routed: RoutedRequest, attempts: Attempts, exc: Exception) -> GatewayError:
    tried = "; ".join(attempts.log) or "nothing"
    headers = {}
    if attempts.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(attempts.retry_after_s)))
    if attempts.tried or attempts.num_failures:
        return UpstreamsFailed(f"all upstreams failed for model {routed.facts.model!r}; tried: {tried}",
                               headers=headers)
    return NoUpstreamAvailable(f"no upstream available for model {routed.facts.model!r}: {tried}", headers=headers)
