"""Connector names (`KVConnectorName`, in backends/core/engine_config.py with the list that names them)
and the one table from name to factory; `build_kv_connector` builds what an `EngineConfig` names, in its
order, and composes several into one `MultiConnector`.
Adding a connector = one file in kv_connectors/ with a `ConnectorFactory`, one member of `KVConnectorName`
and one line in `_FACTORIES`."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from backends.core.block_events import KVEventRing
from backends.core.engine_config import EngineConfig, KVConnectorName
from backends.kv_connectors.base import KVConnector
from backends.kv_connectors.multi import MultiConnector
from backends.kv_connectors.pd_connector import build_pd_connector
from backends.kv_connectors.tiers.factory import build_tiered_connector

__all__ = ["ConnectorFactory", "KVConnectorName", "build_kv_connector", "connector_factory"]

# (engine config, the runner's KV cache (backends/worker/kv_cache.KVCache), the weights' fingerprint ("": none),
# the engine's KV event ring) -> a connector
ConnectorFactory = Callable[[EngineConfig, Any, str, KVEventRing], KVConnector]

_FACTORIES: Mapping[KVConnectorName, ConnectorFactory] = MappingProxyType({
    KVConnectorName.PD: build_pd_connector,
    KVConnectorName.TIERS: build_tiered_connector,
})


def connector_factory(name: KVConnectorName | str) -> ConnectorFactory:
    """The factory for `name`; ValueError for a name no connector has."""
    try:
        return _FACTORIES[KVConnectorName(name)]
    except ValueError:
        raise ValueError(f"unknown KV connector {name!r} (known: {', '.join(n.value for n in _FACTORIES)})") from None


def build_kv_connector(config: EngineConfig, kv_cache: Any, weights_fingerprint: str,
                       events: KVEventRing) -> KVConnector | None:
    """The connectors `config.kv_connector_names` names, in order: None for none, the one itself for one,
    else a MultiConnector over them."""
    connectors = [connector_factory(name)(config, kv_cache, weights_fingerprint, events)
                  for name in config.kv_connector_names]
    if not connectors:
        return None
    return connectors[0] if len(connectors) == 1 else MultiConnector(*connectors)
