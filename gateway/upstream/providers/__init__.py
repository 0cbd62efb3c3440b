"""The provider-kind registry: each `ProviderKind` member names its kind's module (gateway/config); adding a
kind is one module here and one member there."""
from __future__ import annotations

import importlib
from collections.abc import Callable

from gateway.config.gateway_config import ProviderConfig, ProviderKind
from gateway.upstream.providers.base import Provider, ProviderRun


def provider_class(kind: ProviderKind) -> Callable[[ProviderConfig], Provider]:
    """What builds a provider of `kind`, imported from the module its member names."""
    module, attribute = kind.target.split(":")
    built: Callable[[ProviderConfig], Provider] = getattr(importlib.import_module(module), attribute)
    return built


def make_provider(config: ProviderConfig) -> Provider:
    return provider_class(config.kind)(config)


__all__ = ["Provider", "ProviderRun", "make_provider", "provider_class"]
