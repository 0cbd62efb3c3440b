"""Per-endpoint circuit breakers: open after N consecutive failures, one half-open probe after a cool-down;
an endpoint that answered with Retry-After is held off (no new requests) until then.

`eligible()` enforces the provider-wide rule that never every endpoint is ejected at once: if all
would be open, the least-recently-failed one stays eligible. Clock injected for tests; no I/O.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from enum import IntEnum

from gateway.config.gateway_config import BreakerConfig


class CircuitState(IntEnum):
    CLOSED = 0      # traffic flows
    HALF_OPEN = 1   # cool-down over: one probe at a time decides
    OPEN = 2        # ejected until the cool-down ends


_CLOSED = CircuitState.CLOSED   # an IntEnum member read on a hot path: looked up once


class CircuitBreaker:
    """One endpoint's breaker. Not thread-safe: it lives on the event loop."""

    __slots__ = (
        "_clock",
        "_config",
        "_failures",
        "_held_until",
        "_last_failure_at",
        "_on_change",
        "_on_update",
        "_opened_at",
        "_probe_in_flight",
        "_state",
        "endpoint_id",
    )

    def __init__(self, endpoint_id: str, config: BreakerConfig, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, CircuitState], None] | None = None,
                 on_update: Callable[[str], None] | None = None) -> None:
        self.endpoint_id = endpoint_id
        self._config = config
        self._clock = clock
        self._failures = 0
        self._opened_at = 0.0
        self._last_failure_at = float("-inf")
        self._held_until = float("-inf")
        self._probe_in_flight = False
        self._state = CircuitState.CLOSED
        self._on_change = on_change
        self._on_update = on_update   # told of a state change or a hold-off (live_pools.py re-reads the breaker)

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self._config.cooldown_s:
            self._set(CircuitState.HALF_OPEN)
            self._probe_in_flight = False
        return self._state

    @property
    def last_failure_at(self) -> float:
        return self._last_failure_at

    def allows(self) -> bool:
        """May a request be sent now? (A half-open breaker admits one probe at a time.)"""
        if self._held_until > self._clock():
            return False
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        return state is CircuitState.HALF_OPEN and not self._probe_in_flight

    def is_closed(self) -> bool:
        """Closed and not held off: traffic flows with no probe or wait (a pool's live view counts it usable)."""
        return self._state is _CLOSED and self._held_until <= self._clock()

    def on_attempt(self) -> None:
        """Called when a request is actually sent; marks the half-open probe as taken."""
        if self.state is CircuitState.HALF_OPEN:
            self._probe_in_flight = True

    def hold_off(self, seconds: float) -> None:
        """The endpoint asked for no requests for `seconds` (its Retry-After, capped by the caller)."""
        if seconds > 0:
            self._held_until = max(self._held_until, self._clock() + seconds)
            if self._on_update is not None:
                self._on_update(self.endpoint_id)

    def on_success(self) -> None:
        self._failures = 0
        self._probe_in_flight = False
        if self._state is not CircuitState.CLOSED:
            self._set(CircuitState.CLOSED)

    def on_failure(self) -> None:
        now = self._clock()
        self._failures += 1
        self._last_failure_at = now
        self._probe_in_flight = False
        if self._state is CircuitState.HALF_OPEN or self._failures >= self._config.failure_threshold:
            self._opened_at = now
            self._set(CircuitState.OPEN)

    def _set(self, state: CircuitState) -> None:
        if state is not self._state:
            self._state = state
            if self._on_update is not None:
                self._on_update(self.endpoint_id)
            if self._on_change is not None:
                self._on_change(self.endpoint_id, state)


def eligible(breakers: Sequence[CircuitBreaker]) -> list[CircuitBreaker]:
    """The breakers that admit a request; if none does, the least-recently-failed one (never zero)."""
    allowed = [b for b in breakers if b.allows()]
    if allowed or not breakers:
        return allowed
    return [min(breakers, key=lambda b: b.last_failure_at)]
