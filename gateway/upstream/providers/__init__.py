"""The provider-kind registry: adding a kind is one module and one line here."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gateway.config.gateway_config import ProviderConfig, ProviderKind
from gateway.upstream.providers.anthropic import AnthropicProvider
from gateway.upstream.providers.base import Provider, ProviderRun
from gateway.upstream.providers.openai import OpenAIProvider
from gateway.upstream.providers.switchyard_pd import SwitchyardPdProvider
from gateway.upstream.providers.vllm_pd import vllm_pd_provider

PROVIDER_KINDS: Mapping[ProviderKind, Callable[[ProviderConfig], Provider]] = MappingProxyType({
    ProviderKind.OPENAI: OpenAIProvider,
    ProviderKind.SWITCHYARD_PD: SwitchyardPdProvider,
    ProviderKind.ANTHROPIC: AnthropicProvider,
    ProviderKind.VLLM_PD: vllm_pd_provider,
})


def make_provider(config: ProviderConfig) -> Provider:
    return PROVIDER_KINDS[config.kind](config)


__all__ = ["PROVIDER_KINDS", "Provider", "ProviderRun", "make_provider"]
