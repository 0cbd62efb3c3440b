"""The `models` section of the gateway's configuration: each name clients may send (its aliases too), its
provider chain, policy and per-model settings. Reads only the mapping `gateway/config/gateway_config.py` hands it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config.yaml_fields import ConfigError, as_mapping, check_known, typed_field


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    name: str = "least_tokens"           # a policies.registry.PolicyName value
    options: Mapping[str, Any] = field(default_factory=dict)  # passed to make_policy as is
    # The config names it: it then routes every pool that computes the model's prompts, a disaggregated
    # provider's prefill pool too (else that pool keeps its own default: switchyard_pd.py).
    named: bool = False


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str                            # the model name clients send
    providers: tuple[str, ...]           # ordered fallback chain of provider names
    tokenizer: Path | None = None        # folder with tokenizer.json; None: chars/4 estimate
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    block_size: int = 16                 # tokens per KV block, as the workers hash them
    session_ttl_s: float = 600.0         # how long an x-session-affinity assignment lives
    mid_stream_failover: bool = True     # a stream whose upstream dies is continued on another endpoint
    response_cache_ttl_s: float | None = None   # this model's response_cache.ttl_s (0: none); None: the global one
    aliases: tuple[str, ...] = ()        # other names clients may send for it (e.g. a hosted model's name)



def build_model(name: str, raw: Any, base_dir: Path) -> ModelConfig:
    where = f"models.{name}"
    raw = as_mapping(raw, where)
    check_known(raw, set(ModelConfig.__dataclass_fields__) - {"name"}, where)
    chain = raw.get("providers")
    if isinstance(chain, str):
        chain = [chain]
    if not isinstance(chain, list) or not chain:
        raise ConfigError(f"{where}.providers: expected a non-empty list of provider names")
    policy_raw = as_mapping(raw.get("policy"), f"{where}.policy")
    if isinstance(raw.get("policy"), str):
        policy_raw = {"name": raw["policy"]}
    check_known(policy_raw, {"name", "options"}, f"{where}.policy")
    policy = PolicyConfig(name=str(policy_raw.get("name", "least_tokens")),
                          options=dict(as_mapping(policy_raw.get("options"), f"{where}.policy.options")),
                          named="name" in policy_raw)
    tokenizer = raw.get("tokenizer") or None
    block_size = typed_field(raw, "block_size", int, 16, where)
    if block_size <= 0:
        raise ConfigError(f"{where}.block_size: must be positive")
    cache_ttl_s = typed_field(raw, "response_cache_ttl_s", float, None, where)
    if cache_ttl_s is not None and cache_ttl_s < 0:
        raise ConfigError(f"{where}.response_cache_ttl_s: must be >= 0")
    return ModelConfig(
        name=name, providers=tuple(str(p) for p in chain),
        tokenizer=base_dir / str(tokenizer) if tokenizer else None, policy=policy, block_size=block_size,
        session_ttl_s=typed_field(raw, "session_ttl_s", float, 600.0, where),
        mid_stream_failover=typed_field(raw, "mid_stream_failover", bool, True, where),
        response_cache_ttl_s=cache_ttl_s,
        aliases=_aliases(raw.get("aliases"), f"{where}.aliases"),
    )


def _aliases(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(name, str) and name for name in raw):
        raise ConfigError(f"{where}: expected a list of model names")
    return tuple(raw)


def models_by_name(models: Mapping[str, ModelConfig]) -> dict[str, ModelConfig]:
    """Every name a client may send, its aliases included, to its model; ConfigError where two models claim
    one name."""
    named = dict(models)
    for model in models.values():
        for alias in model.aliases:
            if alias in named:
                raise ConfigError(f"models.{model.name}.aliases: {alias!r} already names model "
                                  f"{named[alias].name!r}")
            named[alias] = model
    return named
