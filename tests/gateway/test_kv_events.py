"""The vLLM KV event consumer's pure parts: who binds, how engines share a socket, and how a stream's
sequence numbers (restart, gaps) and malformed messages are handled, on a real prefix index."""
from __future__ import annotations

import msgpack
import pytest

from cache.block_hash import block_hashes
from cache.prefix_index import PrefixIndex
from cache.vllm_events import VllmBlockMap
from gateway.config.gateway_config import ConfigError, KvEventSource, parse_config
from gateway.routing.vllm_kv_events import EngineStream, KvEventConsumer, plan_sockets, subscriber_address
from tests.support.ports import free_port


@pytest.mark.parametrize(("endpoint", "url", "expected"), [
    ("tcp://127.0.0.1:5557", "http://10.0.0.7:8000", ("tcp://127.0.0.1:5557", True)),   # vLLM connects: we bind
    ("tcp://*:5557", "http://10.0.0.7:8000", ("tcp://10.0.0.7:5557", False)),           # vLLM binds: we connect
    ("tcp://*:5557", "http://[fd00::1]:8000", ("tcp://[fd00::1]:5557", False)),
    ("tcp://[::]:5557", "http://vllm-0:8000", ("tcp://vllm-0:5557", False)),
    ("ipc:///tmp/kv-a", "http://127.0.0.1:8000", ("ipc:///tmp/kv-a", False)),
])
def test_subscriber_address(endpoint: str, url: str, expected: tuple[str, bool]) -> None:
    assert subscriber_address(KvEventSource(endpoint), url) == expected


def config(sources: str) -> str:
    return f"""
providers:
  v:
    endpoints: [http://127.0.0.1:8001, http://127.0.0.1:8002, http://127.0.0.1:8003]
    kv_event_sources: {sources}
models: {{m: {{providers: [v], policy: {{name: prefix_aware}}}}}}
"""


def test_engines_share_a_bound_socket_by_topic() -> None:
    plans = plan_sockets(parse_config(config(
        "{http://127.0.0.1:8001: {endpoint: 'tcp://127.0.0.1:5557', topic: a},"
        " http://127.0.0.1:8002: {endpoint: 'tcp://127.0.0.1:5557', topic: b},"
        " http://127.0.0.1:8003: 'tcp://*:5558'}"), {}))
    assert [(p.address, p.bind, dict(p.topics)) for p in plans] == [
        ("tcp://127.0.0.1:5557", True, {"a": "http://127.0.0.1:8001", "b": "http://127.0.0.1:8002"}),
        ("tcp://127.0.0.1:5558", False, {"": "http://127.0.0.1:8003"})]
    with pytest.raises(ValueError, match="topic"):
        plan_sockets(parse_config(config(
            "{http://127.0.0.1:8001: 'tcp://127.0.0.1:5557', http://127.0.0.1:8002: 'tcp://127.0.0.1:5557'}"), {}))


def frames(topic: bytes, seq: int, *events: object) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([0.0, list(events), 0], use_bin_type=True)]


def stored(tokens: list[int], first_hash: int = 1) -> dict:
    return {"type": "BlockStored", "block_hashes": list(range(first_hash, first_hash + len(tokens) // 16)),
            "parent_block_hash": None, "token_ids": tokens, "block_size": 16, "medium": "GPU"}


def test_offload_tier_events_land_in_their_medium() -> None:
    """vLLM's CPU offload (medium CPU) and storage tiers (STORAGE, LOCAL: our disk) are indexed in their
    medium; a GPU eviction leaves the CPU copy; a medium we cannot rank is skipped."""
    cfg = parse_config(config("{http://127.0.0.1:8001: {endpoint: 'tcp://127.0.0.1:5557', topic: a}}"), {})
    index = PrefixIndex()
    stream = EngineStream("http://127.0.0.1:8001", VllmBlockMap(16))
    apply = KvEventConsumer(cfg, index).apply_frames
    prompt = list(range(64))
    ours = block_hashes(prompt, 16)
    apply(frames(b"a", 1, stored(prompt), {**stored(prompt[:32]), "medium": "CPU"},
                 {**stored(prompt), "medium": "STORAGE", "locality": "LOCAL"},
                 {**stored(list(range(500, 532)), 90), "medium": "NVME_OF"}), {b"a": stream})
    assert index.matched_blocks_by_medium(ours) == {stream.endpoint_id: (4, 0, 0, 0)}
    assert index.matched_blocks_by_medium(block_hashes(list(range(500, 532)), 16)) == {}
    apply(frames(b"a", 2, {"type": "BlockRemoved", "block_hashes": [1, 2, 3, 4], "medium": "GPU"}), {b"a": stream})
    assert index.matched_blocks_by_medium(ours) == {stream.endpoint_id: (0, 2, 2, 0)}
    apply(frames(b"a", 3, {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}), {b"a": stream})
    assert index.matched_blocks_by_medium(ours) == {stream.endpoint_id: (0, 1, 3, 0)}  # block 1 from disk


def test_sequence_restart_gaps_and_clears() -> None:
    cfg = parse_config(config("{http://127.0.0.1:8001: {endpoint: 'tcp://127.0.0.1:5557', topic: a}}"), {})
    index = PrefixIndex()
    consumer = KvEventConsumer(cfg, index)
    stream = EngineStream("http://127.0.0.1:8001", VllmBlockMap(16))
    streams = {b"a": stream}
    prompt = list(range(64))
    ours = block_hashes(prompt, 16)
    consumer.apply_frames(frames(b"a", 5, stored(prompt)), streams)  # joined late: seq 5 first is fine
    assert index.num_matched_blocks(stream.endpoint_id, ours) == 4
    consumer.apply_frames(frames(b"a", 9, {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}),
                          streams)  # a gap: applied anyway
    assert index.num_matched_blocks(stream.endpoint_id, ours) == 2
    consumer.apply_frames(frames(b"zz", 10, stored(prompt)), streams)  # nobody's topic: ignored
    consumer.apply_frames(frames(b"a", 0, stored(prompt[:32], first_hash=50)), streams)  # vLLM restarted
    assert index.num_matched_blocks(stream.endpoint_id, ours) == 2 and index.num_blocks(stream.endpoint_id) == 2
    consumer.apply_frames(frames(b"a", 1, {"type": "AllBlocksCleared"}), streams)
    assert index.num_blocks(stream.endpoint_id) == 0
    with pytest.raises(ValueError):
        consumer.apply_frames([b"a", b"\x00", b""], streams)
    with pytest.raises(ValueError):
        consumer.apply_frames([b"a", (2).to_bytes(8, "big"), b"\xc1"], streams)


@pytest.mark.parametrize(("sources", "message"), [
    ("{http://127.0.0.1:9999: 'tcp://*:5557'}", "not one of the provider's endpoints"),
    ("{http://127.0.0.1:8001: 'http://x:5557'}", "ZMQ address"),
    ("{http://127.0.0.1:8001: {endpoint: 'tcp://*:5557', topics: [a]}}", "unknown field"),
    ("{http://127.0.0.1:8001: {topic: a}}", "ZMQ address"),
    ("[tcp://*:5557]", "expected a mapping"),
])
def test_bad_kv_event_sources_fail_at_load(sources: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(config(sources), {})


def test_provider_prefix_options() -> None:
    cfg = parse_config(config("{http://127.0.0.1:8001: 'ipc:///tmp/kv'}"), {})
    provider = cfg.providers["v"]
    assert provider.kv_event_sources == {"http://127.0.0.1:8001": KvEventSource("ipc:///tmp/kv", "")}
    assert (provider.kv_capacity_tokens, provider.offers_vllm_metrics) == (262144, False)
    with pytest.raises(ConfigError, match="kv_capacity_tokens"):
        parse_config(config("{}").replace("kv_event_sources: {}", "kv_capacity_tokens: 0"), {})


async def test_a_second_process_binding_the_same_address_fails_clearly() -> None:
    port = free_port()
    cfg = parse_config(config(f"{{http://127.0.0.1:8001: 'tcp://127.0.0.1:{port}'}}"), {})
    first, second = KvEventConsumer(cfg, PrefixIndex()), KvEventConsumer(cfg, PrefixIndex())
    first.start()
    try:
        with pytest.raises(RuntimeError, match="only one gateway process"):
            second.start()
    finally:
        await first.stop()
        await second.stop()
