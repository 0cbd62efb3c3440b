"""What the gateway is told about vLLM endpoints beyond their URLs: where each publishes its KV events, and
where a vLLM prefill endpoint's KV connector lets a decode endpoint fetch its blocks. Parses the provider's
entries only; it opens nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config.discovery import is_discovered
from gateway.config.yaml_fields import ConfigError, as_mapping, check_known, typed_field


@dataclass(frozen=True, slots=True)
class KvEventSource:
    endpoint: str                        # vLLM's --kv-events-config endpoint (routing/vllm_kv_events.py)
    topic: str = ""                      # vLLM's `topic`: tells engines apart on one socket


@dataclass(frozen=True, slots=True)
class KvBootstrap:
    """A vLLM prefill endpoint as its decode peers reach its KV connector (MooncakeConnector's fields)."""
    engine_id: str                       # the prefill server's --kv-transfer-config `engine_id`
    bootstrap_addr: str                  # http://HOST:PORT of its bootstrap server (VLLM_MOONCAKE_BOOTSTRAP_PORT)


def kv_event_sources(raw: Any, urls: tuple[str, ...], where: str) -> dict[str, KvEventSource]:
    where = f"{where}.kv_event_sources"
    sources = {}
    for url, body in _by_endpoint(raw, urls, where).items():
        body = {"endpoint": body} if isinstance(body, str) else as_mapping(body, f"{where}.{url}")
        check_known(body, {"endpoint", "topic"}, f"{where}.{url}")
        endpoint = typed_field(body, "endpoint", str, None, f"{where}.{url}")
        if not endpoint or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"{where}.{url}.endpoint: expected a ZMQ address like tcp://host:5557")
        sources[url] = KvEventSource(endpoint, typed_field(body, "topic", str, "", f"{where}.{url}"))
    return sources


def kv_bootstraps(raw: Any, prefill_urls: tuple[str, ...], where: str) -> dict[str, KvBootstrap]:
    where = f"{where}.kv_bootstrap"
    peers = {}
    for url, body in _by_endpoint(raw, prefill_urls, where).items():
        body = as_mapping(body, f"{where}.{url}")
        check_known(body, {"engine_id", "bootstrap_addr"}, f"{where}.{url}")
        engine_id = typed_field(body, "engine_id", str, None, f"{where}.{url}")
        addr = typed_field(body, "bootstrap_addr", str, None, f"{where}.{url}")
        if not engine_id or not addr or not addr.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.{url}: expected engine_id and bootstrap_addr (http://host:port)")
        peers[url] = KvBootstrap(engine_id, addr.rstrip("/"))
    return peers


def _by_endpoint(raw: Any, urls: tuple[str, ...], where: str) -> dict[str, Any]:
    """The entries keyed by one of `urls` (trailing slash dropped); a DNS-discovered entry has none of its own."""
    entries = {}
    for url, body in as_mapping(raw, where).items():
        if str(url).rstrip("/") not in urls or is_discovered(str(url)):
            raise ConfigError(f"{where}: {url!r} is not one of the provider's endpoints (a dns+http:// entry "
                              f"has none of its own)")
        entries[str(url).rstrip("/")] = body
    return entries
