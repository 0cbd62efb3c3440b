"""gateway/routing/endpoints.py: the circuit breaker's state machine, and never ejecting every endpoint."""
from __future__ import annotations

from gateway.config.gateway_config import BreakerConfig
from gateway.routing.endpoints import CircuitBreaker, CircuitState, eligible
from tests.support.clock import ManualClock


def test_breaker_state_machine() -> None:
    clock = ManualClock()
    changes: list[CircuitState] = []
    breaker = CircuitBreaker("e", BreakerConfig(failure_threshold=3, cooldown_s=10), clock,
                             on_change=lambda _, state: changes.append(state))
    for _ in range(2):
        breaker.on_attempt()
        breaker.on_failure()
    breaker.on_success()  # a success resets the consecutive count
    for _ in range(3):
        assert breaker.allows()
        breaker.on_failure()
    assert breaker.state is CircuitState.OPEN and not breaker.allows()
    clock.now += 10
    assert breaker.state is CircuitState.HALF_OPEN and breaker.allows()
    breaker.on_attempt()
    assert not breaker.allows()  # one probe at a time
    breaker.on_failure()  # the probe failed: open again for a full cool-down
    assert breaker.state is CircuitState.OPEN
    clock.now += 10
    breaker.on_attempt()
    breaker.on_success()
    assert breaker.state is CircuitState.CLOSED
    assert changes == [CircuitState.OPEN, CircuitState.HALF_OPEN, CircuitState.OPEN, CircuitState.HALF_OPEN,
                       CircuitState.CLOSED]


def test_never_every_breaker_is_ejected() -> None:
    clock = ManualClock()
    breakers = [CircuitBreaker(name, BreakerConfig(failure_threshold=1, cooldown_s=60), clock) for name in "abc"]
    for b in breakers:
        clock.now += 1
        b.on_failure()
    assert [b.endpoint_id for b in eligible(breakers)] == ["a"]  # the least recently failed stays
    assert eligible([]) == []


def test_retry_after_holds_an_endpoint_off_until_then() -> None:
    clock = ManualClock()
    breaker = CircuitBreaker("e", BreakerConfig(failure_threshold=100, cooldown_s=10), clock)
    other = CircuitBreaker("f", BreakerConfig(failure_threshold=100, cooldown_s=10), clock)
    breaker.hold_off(0.0)                      # a zero cap: never held
    assert breaker.allows()
    breaker.hold_off(5.0)
    breaker.hold_off(1.0)                      # a shorter one later does not cut the first short
    assert not breaker.allows() and breaker.state is CircuitState.CLOSED
    assert eligible([breaker, other]) == [other]
    clock.now += 4.9
    assert not breaker.allows()
    clock.now += 0.1
    assert breaker.allows()
    other.hold_off(5.0)
    breaker.hold_off(5.0)
    assert len(eligible([breaker, other])) == 1   # every endpoint held: one still takes traffic
