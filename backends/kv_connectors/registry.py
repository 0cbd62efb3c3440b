"""Connector names (`KVConnectorName`, in backends/core/engine_config.py with the list that names them, each
member with its factory's module); `build_kv_connector` builds what an `EngineConfig` names, in its order, and
composes several into one `MultiConnector`. A connector's module is imported only when a worker uses it.
Adding a connector = one file in kv_connectors/ with a `ConnectorFactory`, and one member of `KVConnectorName`."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from backends.core.block_events import KVEventRing
from backends.core.engine_config import EngineConfig, KVConnectorName
from backends.kv_connectors.base import KVConnector
from backends.kv_connectors.multi import MultiConnector

__all__ = ["ConnectorFactory", "KVConnectorName", "build_kv_connector", "connector_factory"]

# (engine config, the runner's KV cache (backends/worker/kv_cache.KVCache), the weights' fingerprint ("": none),
# the engine's KV event ring) -> a connector
ConnectorFactory = Callable[[EngineConfig, Any, str, KVEventRing], KVConnector]

def connector_factory(name: KVConnectorName | str) -> ConnectorFactory:
    """The factory for `name`; ValueError for a name no connector has."""
    try:
        member = KVConnectorName(name)
    except ValueError:
        known = ", ".join(n.value for n in KVConnectorName)
        raise ValueError(f"unknown KV connector {name!r} (known: {known})") from None
    module, function = member.target.split(":")
    factory: ConnectorFactory = getattr(importlib.import_module(module), function)
    return factory


def build_kv_connector(config: EngineConfig, kv_cache: Any, weights_fingerprint: str,
                       events: KVEventRing) -> KVConnector | None:
    """The connectors `config.kv_connector_names` names, in order: None for none, the one itself for one,
    else a MultiConnector over them."""
    connectors = [connector_factory(name)(config, kv_cache, weights_fingerprint, events)
                  for name in config.kv_connector_names]
    if not connectors:
        return None
    return connectors[0] if len(connectors) == 1 else MultiConnector(*connectors)
