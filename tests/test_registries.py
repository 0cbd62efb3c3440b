"""Every extension point's registry is one enum whose members name their implementation (docs/architecture.md,
"Extension points"): each member's target must import and be the kind of thing its registry builds, so that a
misspelt path fails here and not on the first worker or gateway configured with it."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from backends.attention.base import AttentionBackend, AttentionBackendName
from backends.core.engine_config import KVConnectorName
from backends.kv_connectors.registry import connector_factory
from gateway.config.gateway_config import ProviderKind
from gateway.upstream.providers import provider_class
from policies.registry import PolicyName, make_policy


def _load(target: str) -> object:
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


@pytest.mark.parametrize("kind", list(ProviderKind))
def test_each_provider_kind_names_a_class_with_start(kind: ProviderKind) -> None:
    built = provider_class(kind)
    assert callable(built) and built is _load(kind.target)
    # a class, or a function that builds one (vllm-pd's): either way what it builds has `start`
    assert (inspect.isclass(built) and hasattr(built, "start")) or inspect.isfunction(built)


def _defines_class(target: str) -> bool:
    """The module of `target` defines its class, read from its source without importing it."""
    module, attribute = target.split(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"no module {module}"
    tree = ast.parse(Path(spec.origin).read_text())
    return any(isinstance(node, ast.ClassDef) and node.name == attribute for node in tree.body)


@pytest.mark.parametrize("name", list(AttentionBackendName))
def test_each_attention_backend_names_a_backend_class(name: AttentionBackendName) -> None:
    try:
        backend = _load(name.target)
    except ModuleNotFoundError as exc:   # a GPU backend's own library (triton, flash_attn) is not installed here
        assert exc.name in ("triton", "flash_attn"), exc
        assert _defines_class(name.target)
        return
    assert inspect.isclass(backend) and issubclass(backend, AttentionBackend)
    assert backend.name is name   # the class says which member it is


@pytest.mark.parametrize("name", list(KVConnectorName))
def test_each_kv_connector_names_a_factory(name: KVConnectorName) -> None:
    factory = connector_factory(name)
    assert factory is _load(name.target)
    assert len(inspect.signature(factory).parameters) == 4   # (engine config, KV cache, fingerprint, events)


def test_an_unknown_kv_connector_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown KV connector 'lmcache' \(known: pd, tiers\)"):
        connector_factory("lmcache")


@pytest.mark.parametrize("name", list(PolicyName))
def test_each_policy_name_builds_its_policy(name: PolicyName) -> None:
    policy = make_policy(name)
    assert callable(policy.select)
    assert PolicyName(name.value) is name   # a config's string finds its member


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        make_policy("fastest")   # type: ignore[arg-type]
