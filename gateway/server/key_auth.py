"""API keys: configured plain (expanded from `${ENV}` by config) or as a sha256 digest, held only as
digests, checked in constant time. No keys configured means authentication is off: `from_config`
returns None and the gateway serves every request unauthenticated and unlimited.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.config.gateway_config import ApiKeyConfig
from gateway.state.base import RateLimits

# A digest may also be given in the plain `key` field as "sha256:<64 hex digits>".
_DIGEST_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
DAY_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str                            # stable name for limits, usage and logs (never the secret)
    key_sha256: bytes = field(repr=False)  # sha256 digest of the secret (the secret itself is never kept)
    max_requests_per_min: int | None = None  # None: unlimited
    max_tokens_per_min: int | None = None    # prompt + completion tokens; None: unlimited
    admin: bool = False                    # may read any key's usage, and /metrics
    max_concurrent_requests: int | None = None  # generation requests in flight on one replica; None: unlimited
    models: frozenset[str] | None = None   # the models this key may use; None: every one
    max_tokens_per_day: int | None = None  # prompt + completion tokens over a rolling day; None: no quota

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def limits(self) -> RateLimits:
        return RateLimits(self.max_requests_per_min, self.max_tokens_per_min, window_s=60.0)

    @property
    def daily_limits(self) -> RateLimits | None:
        return None if self.max_tokens_per_day is None else RateLimits(None, self.max_tokens_per_day, DAY_S)


class Authenticator:
    """Maps `Authorization: Bearer <key>` to the configured ApiKey."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        if not keys:
            raise ValueError("an Authenticator needs at least one key (no keys: authentication is off)")
        self._by_digest: dict[bytes, ApiKey] = {}
        for key in keys:
            if len(key.key_sha256) != 32:
                raise ValueError(f"api key {key.key_id!r}: the digest must be 32 bytes of sha256")
            if key.key_sha256 in self._by_digest:
                raise ValueError(f"api keys {self._by_digest[key.key_sha256].key_id!r} and {key.key_id!r} "
                                 "have the same secret")
            self._by_digest[key.key_sha256] = key
        if len({k.key_id for k in keys}) != len(keys):
            raise ValueError("api key ids must be unique")

    @classmethod
    def from_config(cls, entries: Sequence[ApiKeyConfig]) -> Authenticator | None:
        """None when no keys are configured (authentication off); ValueError on a malformed entry."""
        if not entries:
            return None
        return cls([_api_key(entry) for entry in entries])

    def __len__(self) -> int:
        return len(self._by_digest)

    def by_id(self, key_id: str) -> ApiKey | None:
        return next((key for key in self._by_digest.values() if key.key_id == key_id), None)

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> ApiKey | None:
        """The key named by an `Authorization: Bearer <key>` header value or else by an `x-api-key` one
        (as Anthropic's SDK sends it), or None (missing, malformed or unknown: answer 401)."""
        secret = _bearer_token(authorization) or (api_key.strip() if api_key else None)
        if secret is None:
            return None
        digest = hash_secret(secret)
        key = self._by_digest.get(digest)
        # The lookup is by a digest the caller cannot choose; compare_digest keeps the final check
        # constant-time anyway.
        if key is None or not hmac.compare_digest(key.key_sha256, digest):
            return None
        return key


def hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def _api_key(entry: ApiKeyConfig) -> ApiKey:
    if entry.key_sha256 is not None:
        digest_hex = entry.key_sha256
    elif entry.key is not None and entry.key.startswith(_DIGEST_PREFIX):
        digest_hex = entry.key[len(_DIGEST_PREFIX):]
    elif entry.key:
        digest_hex = hash_secret(entry.key).hex()
    else:
        raise ValueError(f"api key {entry.key_id!r}: a key or key_sha256 is required")
    if not _HEX64.fullmatch(digest_hex):
        raise ValueError(f"api key {entry.key_id!r}: a sha256 digest is 64 hex digits")
    return ApiKey(key_id=entry.key_id, key_sha256=bytes.fromhex(digest_hex),
                  max_requests_per_min=entry.max_requests_per_min, max_tokens_per_min=entry.max_tokens_per_min,
                  admin=entry.admin, max_concurrent_requests=entry.max_concurrent_requests,
                  models=frozenset(entry.models) if entry.models is not None else None,
                  max_tokens_per_day=entry.max_tokens_per_day)


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
