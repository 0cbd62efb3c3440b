"""The provider-kind registry: adding a kind is one module and one line here."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gateway.config import ProviderConfig, ProviderKind
from gateway.providers.anthropic import AnthropicProvider
from gateway.providers.base import Provider, ProviderRun
from gateway.providers.openai import OpenAIProvider
from gateway.providers.switchyard_pd import SwitchyardPdProvider

PROVIDER_KINDS: Mapping[ProviderKind, Callable[[ProviderConfig], Provider]] = MappingProxyType({
    ProviderKind.OPENAI: OpenAIProvider,
    ProviderKind.SWITCHYARD_PD: SwitchyardPdProvider,
    ProviderKind.ANTHROPIC: AnthropicProvider,
})


def make_provider(config: ProviderConfig) -> Provider:
    return PROVIDER_KINDS[config.kind](config)


__all__ = ["PROVIDER_KINDS", "Provider", "ProviderRun", "make_provider"]
