"""The Mooncake Store tier against a real `mooncake_master`: round trips, sharing between two clients (two
workers), a corrupt value, and an outage the tier rides out and recovers from by itself."""
from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.kv_connectors.tiers.mooncake_store import MooncakeStoreTier
from tests.support.mooncake import Master
from tests.support.wait import wait_until

try:
    importlib.import_module("mooncake.store")
except ImportError as exc:
    pytest.skip(f"the mooncake client cannot be imported ({exc}): pip install mooncake-transfer-engine-non-cuda, "
                "apt-get install libibverbs1 libnuma1", allow_module_level=True)

BLOCK_NBYTES = 737_280      # one SmolLM2 block: 30 layers x K,V x 16 tokens x 3 KV heads x 64 x 4 bytes (float32)
HASHES = [0x1000 + i for i in range(16)]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    master = Master(tmp_path)
    master.start()
    yield master
    master.kill()


@pytest.fixture
def space() -> str:
    """A namespace of the test's own, as base.namespace would give one model."""
    return os.urandom(8).hex()


def make_tier(master: Master, space: str) -> MooncakeStoreTier:
    return MooncakeStoreTier(master.url, space, BLOCK_NBYTES, segment_bytes=32 << 20, retry_s=0.2)


@pytest.fixture
def tier(master: Master, space: str) -> Iterator[MooncakeStoreTier]:
    tier = make_tier(master, space)
    yield tier
    tier.close()


def block(seed: int) -> memoryview:
    return memoryview(bytes([seed % 251]) * 16 + os.urandom(BLOCK_NBYTES - 16))


def test_round_trip(tier: MooncakeStoreTier) -> None:
    assert tier.is_up
    data = block(1)
    assert tier.put(HASHES[0], data)
    out = bytearray(BLOCK_NBYTES)
    assert tier.get(HASHES[0], memoryview(out))
    assert out == data
    assert not tier.get(HASHES[1], memoryview(out))
    assert (tier.num_puts, tier.num_hits, tier.num_misses, tier.num_errors) == (1, 1, 1, 0)


def test_leading_hits_counts_the_leading_run(tier: MooncakeStoreTier) -> None:
    for h in (*HASHES[:5], HASHES[6]):
        assert tier.put(h, block(h))
    assert tier.leading_hits(HASHES) == 5
    assert tier.leading_hits(HASHES[5:]) == 0
    assert tier.leading_hits(HASHES[6:7]) == 1
    assert tier.leading_hits([]) == 0


def test_two_workers_share_a_block(master: Master, tier: MooncakeStoreTier, space: str) -> None:
    other = make_tier(master, space)
    try:
        data = block(2)
        assert tier.put(HASHES[0], data)
        assert other.leading_hits(HASHES[:1]) == 1
        out = bytearray(BLOCK_NBYTES)
        assert other.get(HASHES[0], memoryview(out))
        assert out == data
    finally:
        other.close()


def test_another_namespace_sees_nothing(master: Master, tier: MooncakeStoreTier) -> None:
    other = make_tier(master, "another-model")
    try:
        assert tier.put(HASHES[0], block(3))
        assert other.leading_hits(HASHES[:1]) == 0
    finally:
        other.close()


def test_a_corrupt_value_is_a_miss_and_removed(master: Master, tier: MooncakeStoreTier) -> None:
    raw = raw_client(master)
    try:
        wrong = bytearray(os.urandom(BLOCK_NBYTES + 32))
        assert raw.put(tier._key(HASHES[0]), bytes(wrong)) == 0
        assert tier.leading_hits(HASHES[:1]) == 1
        assert not tier.get(HASHES[0], memoryview(bytearray(BLOCK_NBYTES)))
        assert (tier.num_corrupt, tier.num_misses, tier.num_hits) == (1, 1, 0)
        assert tier.leading_hits(HASHES[:1]) == 0
        assert tier.is_up
    finally:
        raw.close()


def test_an_outage_is_ridden_out_and_recovered_from(master: Master, tier: MooncakeStoreTier) -> None:
    assert tier.put(HASHES[0], block(4))
    master.kill()
    # Every call answers (no exception, no hang past the tier's deadline) and says "not here".
    wait_until(lambda: tier.leading_hits(HASHES) == 0 and not tier.is_up, "the tier to notice the outage")
    out = memoryview(bytearray(BLOCK_NBYTES))
    assert not tier.get(HASHES[0], out)
    assert not tier.put(HASHES[1], block(5))
    assert tier.num_outages == 1 and tier.num_errors >= 1
    master.start()   # same port, empty: a restarted master forgets every block
    wait_until(lambda: tier.is_up, "the tier to reconnect by itself")
    data = block(6)
    wait_until(lambda: tier.put(HASHES[1], data), "a put after the reconnect")
    assert tier.get(HASHES[1], out)
    assert out == data
    assert tier.num_outages == 1


def test_a_store_down_at_start_is_joined_later(space: str, tmp_path: Path) -> None:
    master = Master(tmp_path)
    tier = make_tier(master, space)
    try:
        assert not tier.is_up and tier.num_outages == 1
        assert tier.leading_hits(HASHES) == 0
        assert not tier.put(HASHES[0], block(7))
        master.start()
        wait_until(lambda: tier.is_up, "the tier to connect once the master is up")
        wait_until(lambda: tier.put(HASHES[0], block(7)), "a put once connected")
    finally:
        tier.close()
        master.kill()


def raw_client(master: Master) -> Any:
    """A plain client beside the tier's, to write behind its back."""
    client = importlib.import_module("mooncake.store").MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{master.port}") == 0
    return client
