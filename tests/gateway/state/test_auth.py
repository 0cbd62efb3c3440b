"""API keys (gateway/server/key_auth.py): plain or sha256 in config, only digests kept, Bearer parsing, errors."""
from __future__ import annotations

import hashlib

import pytest

from gateway.config.gateway_config import ApiKeyConfig
from gateway.server.key_auth import Authenticator
from gateway.state import RateLimits

SECRET_A = "sk-team-a-0123456789"
SECRET_B = "sk-team-b-abcdef"


def _ring() -> Authenticator:
    ring = Authenticator.from_config([
        ApiKeyConfig(key_id="a", key=SECRET_A, max_requests_per_min=60, max_tokens_per_min=1000),
        ApiKeyConfig(key_id="b", key_sha256=hashlib.sha256(SECRET_B.encode()).hexdigest()),
        ApiKeyConfig(key_id="c", key="sha256:" + hashlib.sha256(b"sk-c").hexdigest().upper(), admin=True),
    ])
    assert ring is not None
    return ring


@pytest.mark.parametrize(("header", "key_id"), [
    (f"Bearer {SECRET_A}", "a"),
    (f"bearer   {SECRET_A}  ", "a"),
    (f"Bearer {SECRET_B}", "b"),
    ("Bearer sk-c", "c"),
    (None, None),
    ("", None),
    ("Bearer", None),
    ("Bearer ", None),
    (SECRET_A, None),                          # no scheme
    (f"Basic {SECRET_A}", None),
    (f"Bearer {SECRET_A}x", None),
    (f"Bearer {SECRET_A[:-1]}", None),
    ("Bearer " + hashlib.sha256(SECRET_B.encode()).hexdigest(), None),   # the digest is not the key
    ("Bearer sha256:" + hashlib.sha256(b"sk-c").hexdigest(), None),
])
def test_authenticate(header: str | None, key_id: str | None) -> None:
    key = _ring().authenticate(header)
    assert (key.key_id if key is not None else None) == key_id


def test_keys_carry_limits_and_admin() -> None:
    ring = _ring()
    a = ring.authenticate(f"Bearer {SECRET_A}")
    c = ring.authenticate("Bearer sk-c")
    assert a is not None and c is not None
    assert a.limits == RateLimits(60, 1000, window_s=60.0)
    assert c.limits.unlimited and c.admin and not a.admin


def test_secrets_are_never_kept() -> None:
    ring = _ring()
    key = ring.authenticate(f"Bearer {SECRET_A}")
    assert SECRET_A not in repr(key) and SECRET_A not in repr(vars(ring))
    assert key is not None and key.key_sha256 == hashlib.sha256(SECRET_A.encode()).digest()


def test_no_keys_means_auth_is_off() -> None:
    assert Authenticator.from_config([]) is None


@pytest.mark.parametrize("entries", [
    [ApiKeyConfig(key_id="a", key="sk-1"), ApiKeyConfig(key_id="b", key="sk-1")],          # same secret
    [ApiKeyConfig(key_id="a", key="sk-1"), ApiKeyConfig(key_id="a", key="sk-2")],          # same id
    [ApiKeyConfig(key_id="a", key="sha256:abc")],                                           # short digest
    [ApiKeyConfig(key_id="a", key_sha256="zz" * 32)],                                       # not hex
    [ApiKeyConfig(key_id="a")],                                                             # nothing
])
def test_bad_config_is_rejected(entries: list[ApiKeyConfig]) -> None:
    with pytest.raises(ValueError):
        Authenticator.from_config(entries)
