"""The `api_keys` section of the gateway's configuration: who may call, how much, and which models.

Reads only the mapping `gateway/config/gateway_config.py` hands it; hashing and checking secrets is
`gateway/server/key_auth.py`'s job.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.yaml_fields import ConfigError, as_mapping, check_known, typed_field


@dataclass(frozen=True, slots=True)
class ApiKeyConfig:
    key_id: str                          # stable name used for limits, usage and logs (never the secret)
    key: str | None = None               # the plain secret (usually `${ENV}`); hashed at load by auth
    key_sha256: str | None = None        # or its sha256 hex digest, so no secret sits in the file
    max_requests_per_min: int | None = None  # None: unlimited
    max_tokens_per_min: int | None = None    # prompt + completion tokens; None: unlimited
    max_tokens_per_day: int | None = None    # a quota over a rolling day; None: none
    admin: bool = False                  # may read any key's usage at /v1/usage?key_id=..., and /metrics
    max_concurrent_requests: int | None = None  # generation requests (streams included) in flight per replica
    models: tuple[str, ...] | None = None    # the models this key may use; None: every configured model


def build_keys(raw: Any, model_names: Mapping[str, str]) -> tuple[ApiKeyConfig, ...]:
    """`model_names`: every name a client may send (aliases too) to its model's name."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("api_keys: expected a list")
    return tuple(_build_key(f"api_keys[{i}]", body, model_names) for i, body in enumerate(raw))


def _build_key(where: str, raw: Any, model_names: Mapping[str, str]) -> ApiKeyConfig:
    raw = as_mapping(raw, where)
    check_known(raw, set(ApiKeyConfig.__dataclass_fields__), where)
    key, digest = raw.get("key") or None, raw.get("key_sha256") or None
    if (key is None) == (digest is None):
        raise ConfigError(f"{where}: exactly one of key and key_sha256 is required")
    if digest is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", str(digest)):
        raise ConfigError(f"{where}.key_sha256: expected 64 hex digits")
    key_id = raw.get("key_id")
    if not isinstance(key_id, str) or not key_id:
        raise ConfigError(f"{where}.key_id: required")
    return ApiKeyConfig(
        key_id=key_id, key=str(key) if key is not None else None,
        key_sha256=str(digest).lower() if digest is not None else None,
        max_requests_per_min=_limit(raw, "max_requests_per_min", where),
        max_tokens_per_min=_limit(raw, "max_tokens_per_min", where),
        max_tokens_per_day=_limit(raw, "max_tokens_per_day", where),
        admin=typed_field(raw, "admin", bool, False, where),
        max_concurrent_requests=_limit(raw, "max_concurrent_requests", where),
        models=_models(raw.get("models"), f"{where}.models", model_names),
    )


def _limit(raw: Any, name: str, where: str) -> int | None:
    """A limit: absent (None, no limit) or a positive integer; 0 would refuse every request."""
    value: int | None = typed_field(raw, name, int, None, where)
    if value is not None and value < 1:
        raise ConfigError(f"{where}.{name}: must be at least 1 (leave it out for no limit)")
    return value


def _models(raw: Any, where: str, model_names: Mapping[str, str]) -> tuple[str, ...] | None:
    """The models a key may use, by their configured names: an alias grants its model, under all its names."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(isinstance(name, str) for name in raw):
        raise ConfigError(f"{where}: expected a non-empty list of model names")
    for name in raw:
        if name not in model_names:
            raise ConfigError(f"{where}: unknown model {name!r}")
    return tuple(dict.fromkeys(model_names[name] for name in raw))
