"""`MemoryStore`: the in-process StateStore for a single replica (and Redis's stand-in during an outage).

Same token-bucket algorithm as Redis (`bucket`), on the monotonic clock. Expired entries are swept
every few hundred writes, so memory stays bounded by what is live.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from gateway.state import bucket
from gateway.state.base import UNLIMITED, BreakerState, RateDecision, RateLimits, Usage, sum_counts

# Writes between two sweeps of expired entries (amortises the O(n) sweep).
_SWEEP_EVERY = 512


@dataclass(slots=True)
class _Bucket:
    levels: bucket.Levels     # levels after the last update
    limits: RateLimits        # the limits last used, for settling charges
    expires_s: float          # full again (plus one window) by then: forget it


@dataclass(slots=True)
class _Expiring:
    value: str                # endpoint id or breaker state
    ttl_s: float              # refreshed to this on reads (sessions)
    expires_s: float          # clock reading after which it is gone


class MemoryStore:
    """StateStore in a few dicts; never raises for an outage (there is none)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_response_bytes: int = 64 << 20) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._sessions: dict[str, _Expiring] = {}
        self._breakers: dict[str, _Expiring] = {}
        self._usage: dict[str, Usage] = {}
        # replica -> (its in-flight counts per endpoint, expires_s)
        self._inflight: dict[str, tuple[dict[str, tuple[int, ...]], float]] = {}
        self._routed: deque[tuple[tuple[int, int], str, str]] = deque()  # (id as (ms, n), replica, payload)
        self._num_writes = 0
        # cached answers, least recently used first: key -> (body, expires_s); their bytes bounded
        self._responses: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._response_bytes = 0
        self._max_response_bytes = max_response_bytes

    async def rate_limit(self, key_id: str, limits: RateLimits, cost_tokens: int) -> RateDecision:
        if limits.unlimited:
            return UNLIMITED
        now_s = self._clock()
        entry = self._buckets.get(key_id)
        levels = entry.levels if entry is not None and entry.expires_s > now_s else None
        levels, result = bucket.take(levels, limits, cost_tokens, now_s)
        self._put_bucket(key_id, levels, limits, now_s)
        return result

    async def charge_tokens(self, key_id: str, num_tokens: int) -> None:
        now_s = self._clock()
        entry = self._buckets.get(key_id)
        if entry is None or entry.expires_s <= now_s:
            return  # the bucket has been full for a window: nothing left to settle against
        self._put_bucket(key_id, bucket.charge(entry.levels, entry.limits, num_tokens, now_s), entry.limits, now_s)

    async def get_session(self, session_key: str) -> str | None:
        now_s = self._clock()
        entry = self._live(self._sessions, session_key, now_s)
        if entry is None:
            return None
        entry.expires_s = now_s + entry.ttl_s
        return entry.value

    async def set_session(self, session_key: str, endpoint_id: str, ttl_s: float) -> None:
        now_s = self._clock()
        self._sessions[session_key] = _Expiring(endpoint_id, ttl_s, now_s + ttl_s)
        self._wrote(now_s)

    async def count_sessions(self) -> int:
        now_s = self._clock()
        return sum(1 for entry in self._sessions.values() if entry.expires_s > now_s)

    async def record_usage(self, key_id: str, num_prompt_tokens: int, num_cached_tokens: int,
                           num_completion_tokens: int) -> None:
        old = self._usage.get(key_id, Usage())
        self._usage[key_id] = replace(
            old, num_requests=old.num_requests + 1, num_prompt_tokens=old.num_prompt_tokens + num_prompt_tokens,
            num_cached_tokens=old.num_cached_tokens + num_cached_tokens,
            num_completion_tokens=old.num_completion_tokens + num_completion_tokens)

    async def get_usage(self, key_id: str) -> Usage:
        return self._usage.get(key_id, Usage())

    async def get_breaker(self, endpoint_id: str) -> BreakerState | None:
        entry = self._live(self._breakers, endpoint_id, self._clock())
        return None if entry is None else BreakerState(entry.value)

    async def set_breaker(self, endpoint_id: str, state: BreakerState, ttl_s: float) -> None:
        now_s = self._clock()
        self._breakers[endpoint_id] = _Expiring(state.value, ttl_s, now_s + ttl_s)
        self._wrote(now_s)

    async def share_inflight(self, replica_id: str, counts: Mapping[str, Sequence[int]],
                             ttl_s: float) -> dict[str, list[int]]:
        now_s = self._clock()
        self._inflight[replica_id] = ({e: tuple(c) for e, c in counts.items()}, now_s + ttl_s)
        self._wrote(now_s)
        return sum_counts(c for r, (c, expires_s) in self._inflight.items() if r != replica_id and expires_s > now_s)

    async def publish_routed(self, replica_id: str, payload: str, max_entries: int) -> None:
        ms = time.time_ns() // 1_000_000   # ids as Redis streams give them: wall-clock ms, then a counter
        last = self._routed[-1][0] if self._routed else (0, 0)
        entry_id = (ms, 0) if ms > last[0] else (last[0], last[1] + 1)
        self._routed.append((entry_id, replica_id, payload))
        while len(self._routed) > max_entries:
            self._routed.popleft()

    async def read_routed(self, after: str, max_entries: int) -> tuple[str, list[tuple[str, str]]]:
        ms, _, n = after.partition("-")
        cursor = (int(ms), int(n or 0))
        entries = [(i, r, p) for i, r, p in self._routed if i > cursor][:max_entries]
        if entries:
            cursor = entries[-1][0]
        return f"{cursor[0]}-{cursor[1]}", [(r, p) for _, r, p in entries]

    async def get_response(self, cache_key: str) -> bytes | None:
        entry = self._responses.get(cache_key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            self._drop_response(cache_key)
            return None
        self._responses.move_to_end(cache_key)
        return entry[0]

    async def put_response(self, cache_key: str, body: bytes, ttl_s: float) -> None:
        if len(body) > self._max_response_bytes:
            return
        self._drop_response(cache_key)
        self._responses[cache_key] = (body, self._clock() + ttl_s)
        self._response_bytes += len(body)
        while self._response_bytes > self._max_response_bytes:
            self._drop_response(next(iter(self._responses)))

    def _drop_response(self, cache_key: str) -> None:
        entry = self._responses.pop(cache_key, None)
        if entry is not None:
            self._response_bytes -= len(entry[0])

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    def _put_bucket(self, key_id: str, levels: bucket.Levels, limits: RateLimits, now_s: float) -> None:
        expires_s = now_s + bucket.seconds_until_full(levels, limits) + limits.window_s
        self._buckets[key_id] = _Bucket(levels, limits, expires_s)
        self._wrote(now_s)

    @staticmethod
    def _live(entries: dict[str, _Expiring], key: str, now_s: float) -> _Expiring | None:
        entry = entries.get(key)
        if entry is None or entry.expires_s > now_s:
            return entry
        del entries[key]
        return None

    def _wrote(self, now_s: float) -> None:
        self._num_writes += 1
        if self._num_writes % _SWEEP_EVERY == 0:
            self.sweep(now_s)

    def sweep(self, now_s: float | None = None) -> None:
        """Drop every expired entry (runs by itself every few hundred writes)."""
        now_s = self._clock() if now_s is None else now_s
        for entries in (self._sessions, self._breakers, self._buckets):
            for key in [k for k, e in entries.items() if e.expires_s <= now_s]:
                del entries[key]
        for replica_id in [r for r, (_, expires_s) in self._inflight.items() if expires_s <= now_s]:
            del self._inflight[replica_id]
        for cache_key in [k for k, (_, expires_s) in self._responses.items() if expires_s <= now_s]:
            self._drop_response(cache_key)

    def num_entries(self) -> int:
        """Live and not yet swept entries (for tests and metrics)."""
        return (len(self._sessions) + len(self._breakers) + len(self._buckets)
                + len(self._inflight) + len(self._responses))
