"""Which endpoints the gateway's prefix index feeds approximately, and how a load report sizes them."""
from __future__ import annotations

from cache.prefix_index import PrefixIndex
from gateway.config.gateway_config import parse_config
from gateway.routing.load import LoadReport
from gateway.routing.prefix_feed import configure_prefix_index, index_block_size, on_load_report

CONFIG = """
providers:
  workers: {endpoints: [http://w0:8000], offers_kv_events: true}
  vllm:
    endpoints: [http://v0:8000, http://v1:8000]
    kv_event_sources: {http://v0:8000: 'tcp://*:5557'}
    kv_capacity_tokens: 3200
models:
  a: {providers: [workers, vllm], block_size: 32}
  b: {providers: [vllm], block_size: 16}
"""


def report(num_total_blocks: int, block_size: int) -> LoadReport:
    return LoadReport(0, 0, 0, 0, num_total_blocks, num_total_blocks, 0, block_size)


def test_modes_and_capacity() -> None:
    config = parse_config(CONFIG, {})
    index = PrefixIndex()
    configure_prefix_index(index, config)
    assert index_block_size(config) == 16
    assert [index.is_approximate(e) for e in ("http://w0:8000", "http://v0:8000", "http://v1:8000")] == \
        [False, False, True]  # events (polled or ZMQ) make an endpoint precise
    assert index.capacity("http://v1:8000") == 200  # 3200 tokens / 16
    on_load_report(index, "http://v1:8000", report(1456, 32), 16)  # vLLM's /metrics: 1456 blocks of 32
    assert index.capacity("http://v1:8000") == 2912
    on_load_report(index, "http://v0:8000", report(10, 16), 16)  # precise endpoints keep their bound
    assert not index.is_approximate("http://v0:8000")
    on_load_report(index, "http://v1:8000", report(0, 0), 16)  # no capacity in the report: unchanged
    assert index.capacity("http://v1:8000") == 2912
