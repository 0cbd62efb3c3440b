"""Table-driven tests of the gateway's pure parts: config parsing, breakers, the retry budget, SSE counting."""
from __future__ import annotations

import asyncio

import pytest

from gateway.breaker import CircuitBreaker, CircuitState, eligible
from gateway.config import BreakerConfig, ConfigError, ReadyRequirement, RetryConfig, expand_env, parse_config
from gateway.fallback import Retrier, RetryableFailure, RetryBudget
from gateway.streaming import SseCounter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("text", "env", "expected"), [
    ("${A}", {"A": "x"}, "x"),
    ("${A:-d}", {}, "d"),
    ("${A:-d}", {"A": ""}, "d"),
    ("${A:-}", {}, ""),
    ("a${A}b${B:-c}", {"A": "1"}, "a1bc"),
    ("$A {A}", {}, "$A {A}"),
])
def test_env_expansion(text: str, env: dict[str, str], expected: str) -> None:
    assert expand_env(text, env) == expected


def test_env_expansion_requires_set_variables() -> None:
    with pytest.raises(ConfigError, match="MISSING"):
        expand_env("${MISSING}", {})


MINIMAL = """
models: {m: {providers: [p]}}
providers: {p: {endpoints: ["http://h:1"]}}
"""


def test_minimal_config_has_defaults() -> None:
    config = parse_config(MINIMAL, {})
    assert config.models["m"].providers == ("p",) and config.models["m"].policy.name == "least_tokens"
    assert config.providers["p"].timeouts.first_byte_s == 60.0 and config.ready is ReadyRequirement.EACH_MODEL
    assert config.api_keys == () and config.redis_url is None


@pytest.mark.parametrize(("text", "message"), [
    ("models: {m: {providers: [q]}}\nproviders: {p: {endpoints: ['http://h']}}", "unknown provider"),
    ("providers: {p: {endpoints: []}}", "endpoints"),
    ("providers: {p: {kind: grpc, endpoints: ['http://h']}}", "kind"),
    (MINIMAL + "listen: {port: 70000}", "port"),
    (MINIMAL + "max_body_bytes: 0", "max_body_bytes"),
    (MINIMAL + "retries: {max_attempts: many}", "retries.max_attempts"),
    (MINIMAL + "surprise: 1", "unknown field"),
    (MINIMAL + "api_keys: [{key_id: a}]", "exactly one of key"),
    (MINIMAL + "api_keys: [{key_id: a, key_sha256: abc}]", "64 hex"),
    (MINIMAL + "tracing: {exporter: jaeger}", "tracing.exporter"),
    (MINIMAL + "listen: {tls: {cert_file: c.pem}}", "key_file"),
    ("models: [", "invalid YAML"),
])
def test_config_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text, {})


def test_breaker_state_machine() -> None:
    clock = Clock()
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
    clock = Clock()
    breakers = [CircuitBreaker(name, BreakerConfig(failure_threshold=1, cooldown_s=60), clock) for name in "abc"]
    for b in breakers:
        clock.now += 1
        b.on_failure()
    assert [b.endpoint_id for b in eligible(breakers)] == ["a"]  # the least recently failed stays
    assert eligible([]) == []


def test_retry_budget_caps_retries_by_ratio_and_minimum() -> None:
    clock = Clock()
    budget = RetryBudget(RetryConfig(budget_ratio=0.2, budget_min_retries=2, budget_window_s=10), clock)
    for _ in range(10):
        budget.on_request()
    assert sum(budget.try_spend() for _ in range(10)) == 4  # 2 + 0.2 x 10
    clock.now += 11  # the window slides past everything
    assert sum(budget.try_spend() for _ in range(10)) == 2


def test_retrier_retries_then_gives_up_with_the_last_failure() -> None:
    config = RetryConfig(max_attempts=3, backoff_initial_s=0.001, backoff_max_s=0.001, backoff_jitter_s=0)
    retrier = Retrier(config, RetryBudget(config))
    calls: list[int] = []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RetryableFailure(f"fail {len(calls)}")
        return "ok"

    assert asyncio.run(retrier.run(attempt)) == "ok" and len(calls) == 3

    async def always() -> str:
        calls.append(1)
        raise RetryableFailure(f"fail {len(calls)}")

    calls.clear()
    with pytest.raises(RetryableFailure, match="fail 3"):
        asyncio.run(retrier.run(always))


def test_sse_counter_counts_content_events_across_chunk_boundaries() -> None:
    counter = SseCounter()
    stream = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
              b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
              b': keepalive\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9,'
              b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
              b'data: [DONE]\n\n')
    counts = [counter.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)]
    assert sum(counts) == 2
    assert (counter.usage.num_output_tokens, counter.usage.num_prompt_tokens, counter.usage.num_cached_tokens) == \
        (9, 5, 4)
    assert not counter.mid_event
    counter.feed(b'data: {"cho')
    assert counter.mid_event


def test_the_documented_example_config_parses() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_config(example, {"TEAM_A_KEY": "secret"})
    assert config.models["smollm2"].providers == ("local", "hosted")
    assert config.providers["hosted"].api_key is None and config.redis_url is None
    assert config.api_keys[1].admin and config.listen.tls is not None
    from policies.registry import PolicyName, make_policy
    make_policy(PolicyName(config.models["smollm2"].policy.name), config.models["smollm2"].policy.options)


def test_env_values_fill_typed_fields_and_comments_are_not_expanded() -> None:
    text = MINIMAL + "listen: {port: '${PORT}'}  # ${NOT_SET_ANYWHERE}\nredis_url: ${REDIS_URL:-}\n"
    config = parse_config(text, {"PORT": "9123"})
    assert config.listen.port == 9123 and config.redis_url is None
    with pytest.raises(ConfigError, match="listen.port"):
        parse_config(text, {"PORT": "eighty"})


def test_env_is_expanded_after_parsing_and_quoted_in_flow_collections() -> None:
    """docs/configuration.md: a value cannot change the structure, and `${...}` in `{...}` must be quoted."""
    with_policy = "models: {m: {providers: [p], policy: {name: %s}}}\nproviders: {p: {endpoints: [\"http://h:1\"]}}\n"
    policy = with_policy % '"${POLICY:-power_of_two}"'
    assert parse_config(policy, {}).models["m"].policy.name == "power_of_two"
    assert parse_config(policy, {"POLICY": "least_requests"}).models["m"].policy.name == "least_requests"
    tricky = "x: 1\n  # {not: structure}"  # would add a key or a comment if expanded before parsing
    config = parse_config(MINIMAL + "redis_url: ${URL}\n", {"URL": tricky})
    assert config.redis_url == tricky
    with pytest.raises(ConfigError, match=r"must be quoted"):
        parse_config(with_policy % "${POLICY:-a}", {})


@pytest.mark.parametrize(("argv", "message"), [
    ([], "usage: switchyard"),
    (["frobnicate"], "usage: switchyard"),
    (["gateway", "--config", "/nonexistent/gateway.yaml"], "cannot read config"),
])
def test_cli_rejects_bad_invocations(argv: list[str], message: str) -> None:
    from gateway.cli import main

    with pytest.raises(SystemExit, match=message):
        main(argv)
