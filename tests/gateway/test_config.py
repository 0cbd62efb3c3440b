"""gateway/config/gateway_config.py: parsing, defaults, `${ENV}` expansion after parsing, errors that name the
field, the documented example."""
from __future__ import annotations

import pytest

from gateway.config.gateway_config import ConfigError, ReadyRequirement, expand_env, parse_config


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
    assert not config.models["m"].policy.named   # a disaggregated provider's prefill pool keeps its own default
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
    (MINIMAL + "api_keys: [{key_id: a, key: s, models: [nope]}]", r"api_keys\[0\]\.models: unknown model 'nope'"),
    (MINIMAL + "api_keys: [{key_id: a, key: s, models: []}]", r"api_keys\[0\]\.models: expected a non-empty list"),
    (MINIMAL + "api_keys: {a: 1}", "api_keys: expected a list"),
    (MINIMAL + "tracing: {exporter: jaeger}", "tracing.exporter"),
    (MINIMAL + "listen: {tls: {cert_file: c.pem}}", "key_file"),
    ("models: [", "invalid YAML"),
])
def test_config_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text, {})


def test_the_documented_example_config_parses() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_config(example, {"TEAM_A_KEY": "secret"})
    assert config.models["smollm2"].providers == ("local", "hosted")
    assert config.providers["hosted"].api_key is None and config.redis_url is None
    assert config.api_keys[1].admin and config.listen.tls is not None
    assert config.limits.max_output_tokens == 32768 and not config.limits.metrics_public
    assert config.api_keys[0].max_concurrent_requests == 16 and config.drain_timeout_s == 30.0
    assert config.api_keys[0].models == ("smollm2",) and config.api_keys[1].models is None
    assert config.api_keys[0].max_tokens_per_day == 20000000
    from policies.registry import PolicyName, make_policy
    make_policy(PolicyName(config.models["smollm2"].policy.name), config.models["smollm2"].policy.options)


def test_env_values_fill_typed_fields_and_comments_are_not_expanded() -> None:
    text = MINIMAL + "listen: {port: '${PORT}'}  # ${NOT_SET_ANYWHERE}\nredis_url: ${REDIS_URL:-}\n"
    config = parse_config(text, {"PORT": "9123"})
    assert config.listen.port == 9123 and config.redis_url is None
    with pytest.raises(ConfigError, match=r"listen\.port"):
        parse_config(text, {"PORT": "eighty"})


def test_env_is_expanded_after_parsing_and_quoted_in_flow_collections() -> None:
    """docs/configuration.md: a value cannot change the structure, and `${...}` in `{...}` must be quoted."""
    with_policy = "models: {m: {providers: [p], policy: {name: %s}}}\nproviders: {p: {endpoints: [\"http://h:1\"]}}\n"
    policy = with_policy % '"${POLICY:-power_of_two}"'
    assert parse_config(policy, {}).models["m"].policy.name == "power_of_two"
    assert parse_config(policy, {}).models["m"].policy.named
    assert parse_config(policy, {"POLICY": "least_requests"}).models["m"].policy.name == "least_requests"
    tricky = "redis://x: 1\n  # {not: structure}"  # would add a key or a comment if expanded before parsing
    config = parse_config(MINIMAL + "redis_url: ${URL}\n", {"URL": tricky})
    assert config.redis_url == tricky
    with pytest.raises(ConfigError, match=r"must be quoted"):
        parse_config(with_policy % "${POLICY:-a}", {})
