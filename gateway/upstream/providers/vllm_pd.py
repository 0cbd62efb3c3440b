"""The `vllm-pd` provider kind: vLLM's own prefill/decode split (a KV connector between a producer pool and a
consumer pool), driven as `switchyard-pd` drives ours: the same legs, routing, retries and fallback
(providers/switchyard_pd.py), with vLLM's `kv_transfer_params` on each leg. Only the handshake is vLLM's.
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from gateway.config.discovery import is_discovered
from gateway.config.gateway_config import ConfigError, KvBootstrap, ProviderConfig
from gateway.upstream.providers.switchyard_pd import SwitchyardPdProvider


class VllmHandshake:
    """MooncakeConnector's protocol: the gateway names the transfer (`transfer_id`, the same on both legs), the
    producer answers `kv_transfer_params: null`, and the consumer pulls from the producer's bootstrap server
    (`remote_engine_id`, `remote_bootstrap_addr`, from the provider's `kv_bootstrap`). A connector whose
    producer names its blocks in its answer (NIXL's way) has those sent on as they are. The consumer samples the
    first token again from the pulled KV and answers whole, so the client's first token comes from it."""

    decode_answers_whole = True

    def __init__(self, peers: Mapping[str, KvBootstrap]) -> None:
        self._peers = peers              # prefill endpoint URL -> its connector's engine id and bootstrap server

    def prefill_params(self) -> dict[str, Any]:
        return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": str(uuid.uuid4())}

    def decode_params(self, prefill_endpoint_id: str, sent: Mapping[str, Any],
                      returned: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if returned is not None:
            return returned
        peer = self._peers[prefill_endpoint_id]
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": sent["transfer_id"],
                "remote_engine_id": peer.engine_id, "remote_bootstrap_addr": peer.bootstrap_addr}


def vllm_pd_provider(config: ProviderConfig) -> SwitchyardPdProvider:
    """Every prefill endpoint needs its `kv_bootstrap` entry (a DNS-discovered pool cannot name one)."""
    missing = [url for url in config.prefill_endpoints if url not in config.kv_bootstrap or is_discovered(url)]
    if missing:
        raise ConfigError(f"providers.{config.name}.kv_bootstrap: required for each prefill endpoint of kind "
                          f"vllm-pd, missing for {', '.join(missing)}")
    return SwitchyardPdProvider(config, VllmHandshake(config.kv_bootstrap))
