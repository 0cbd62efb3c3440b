"""Which mode feeds each endpoint's entry in the gateway's one prefix index (cache.PrefixIndex):
precise, from KV events (our workers' `/kv_events`, polled by gateway/routing/endpoints.py; vLLM's ZMQ stream,
gateway/routing/vllm_kv_events.py), or approximate, from the prompts the gateway itself routed there (`Legs.choose`
records them), bounded by an estimate of the endpoint's KV capacity. Decides modes and sizes only.
"""
from __future__ import annotations

from cache.prefix_index import PrefixIndex
from gateway.config.discovery import is_discovered
from gateway.config.gateway_config import GatewayConfig, ProviderConfig
from gateway.routing.load import LoadReport


def index_block_size(config: GatewayConfig) -> int:
    """Tokens per block behind the index's hashes: the models' block size (the smallest of several,
    so a capacity in blocks is never underestimated)."""
    return min((m.block_size for m in config.models.values()), default=16)


def configure_prefix_index(index: PrefixIndex, config: GatewayConfig) -> None:
    """Put every endpoint that publishes no KV events in approximate mode, sized by its provider's
    `kv_capacity_tokens` until a load report gives the real capacity."""
    block_size = index_block_size(config)
    precise = {url for p in config.providers.values() if p.offers_kv_events
               for urls in p.pools().values() for url in urls}
    precise.update(url for p in config.providers.values() for url in p.kv_event_sources)
    for provider in config.providers.values():
        for urls in provider.pools().values():
            for url in urls:   # (a dns+http:// entry's endpoints: gateway/routing/endpoints.py, as they are found)
                if url not in precise and not is_discovered(url):
                    track_approximate(index, url, provider, block_size)


def track_approximate(index: PrefixIndex, url: str, provider: ProviderConfig, block_size: int) -> None:
    """`url`, which publishes no KV events, in approximate mode (once), sized by its provider's capacity."""
    if not index.is_approximate(url):
        index.track_routed(url, provider.kv_capacity_tokens // block_size)


def on_load_report(index: PrefixIndex, endpoint_id: str, report: LoadReport, block_size: int) -> None:
    """An approximate endpoint's LRU follows the KV capacity its load report states; every endpoint is credited
    with the blocks of the shared store it reports reading (none, when its report names none)."""
    index.share_store(endpoint_id, report.shared_store or None)
    if report.num_total_blocks and index.is_approximate(endpoint_id):
        max_blocks = report.num_total_blocks * report.block_size // block_size
        if max_blocks != index.capacity(endpoint_id):
            index.set_capacity(endpoint_id, max_blocks)
