"""`ResilientStore`: a shared primary store (Redis) that degrades to an in-process fallback on an outage.

A Redis outage never fails a request: the first `StoreUnavailable` logs one warning and switches every
call to the fallback; a background probe pings the primary and switches back by itself (info log).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from gateway.state.base import BreakerState, RateDecision, RateLimits, StateStore, StoreUnavailable, Usage

log = logging.getLogger(__name__)

T = TypeVar("T")


class ResilientStore:
    """StateStore over `primary`, answering from `fallback` while the primary is unavailable.

    While degraded, limits are enforced per replica (each holds its own buckets) and sessions set before
    the outage are still known, because `set_session` writes through to the fallback as well.
    """

    def __init__(self, primary: StateStore, fallback: StateStore, probe_interval_s: float = 1.0) -> None:
        self._primary = primary
        self._fallback = fallback
        self._probe_interval_s = probe_interval_s
        self._probe: asyncio.Task[None] | None = None
        self._degraded = False

    @property
    def primary(self) -> StateStore:
        return self._primary

    @property
    def degraded(self) -> bool:
        """True while calls are answered by the fallback (for /health and metrics)."""
        return self._degraded

    async def rate_limit(self, key_id: str, limits: RateLimits, cost_tokens: int) -> RateDecision:
        return await self._call(lambda store: store.rate_limit(key_id, limits, cost_tokens))

    async def charge_tokens(self, key_id: str, num_tokens: int) -> None:
        await self._call(lambda store: store.charge_tokens(key_id, num_tokens))

    async def get_session(self, session_key: str) -> str | None:
        return await self._call(lambda store: store.get_session(session_key))

    async def set_session(self, session_key: str, endpoint_id: str, ttl_s: float) -> None:
        await self._fallback.set_session(session_key, endpoint_id, ttl_s)
        if not self._degraded:
            await self._call(lambda store: store.set_session(session_key, endpoint_id, ttl_s))

    async def count_sessions(self) -> int:
        return await self._call(lambda store: store.count_sessions())

    async def record_usage(self, key_id: str, num_prompt_tokens: int, num_cached_tokens: int,
                           num_completion_tokens: int) -> None:
        await self._call(lambda store: store.record_usage(
            key_id, num_prompt_tokens, num_cached_tokens, num_completion_tokens))

    async def get_usage(self, key_id: str) -> Usage:
        return await self._call(lambda store: store.get_usage(key_id))

    async def get_breaker(self, endpoint_id: str) -> BreakerState | None:
        return await self._call(lambda store: store.get_breaker(endpoint_id))

    async def set_breaker(self, endpoint_id: str, state: BreakerState, ttl_s: float) -> None:
        await self._call(lambda store: store.set_breaker(endpoint_id, state, ttl_s))

    async def share_inflight(self, replica_id: str, counts: Mapping[str, Sequence[int]],
                             ttl_s: float) -> dict[str, list[int]]:
        return await self._call(lambda store: store.share_inflight(replica_id, counts, ttl_s))

    async def publish_routed(self, replica_id: str, payload: str, max_entries: int) -> None:
        await self._call(lambda store: store.publish_routed(replica_id, payload, max_entries))

    async def read_routed(self, after: str, max_entries: int) -> tuple[str, list[tuple[str, str]]]:
        return await self._call(lambda store: store.read_routed(after, max_entries))

    async def get_response(self, cache_key: str) -> bytes | None:
        return await self._call(lambda store: store.get_response(cache_key))

    async def put_response(self, cache_key: str, body: bytes, ttl_s: float) -> None:
        await self._call(lambda store: store.put_response(cache_key, body, ttl_s))

    async def ping(self) -> bool:
        """True if calls are being answered (always: the fallback answers during an outage)."""
        return True

    async def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        await self._primary.close()
        await self._fallback.close()

    async def _call(self, op: Callable[[StateStore], Awaitable[T]]) -> T:
        if not self._degraded:
            try:
                return await op(self._primary)
            except StoreUnavailable as exc:
                self._degrade(exc)
        return await op(self._fallback)

    def _degrade(self, exc: StoreUnavailable) -> None:
        if self._degraded:
            return
        self._degraded = True
        log.warning("shared state store unavailable (%s): serving from in-process state until it is back", exc)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_back())

    async def _probe_until_back(self) -> None:
        while self._degraded:
            await asyncio.sleep(self._probe_interval_s)
            try:
                back = await self._primary.ping()
            except Exception:  # a background loop: log, keep probing
                log.exception("state store probe failed")
                back = False
            if back:
                self._degraded = False
                log.info("shared state store is back: serving shared state again")
