"""RedisStore on a real Redis Cluster: found from one node's plain URL, named by a node list, refused when a
cluster URL names a plain server, and a redirection (MOVED) never taken for an outage. Every other store
behaviour runs on the cluster through the `store` fixtures (tests/gateway/state/conftest.py)."""
from __future__ import annotations

import uuid

import pytest

from gateway.state import (
    MemoryStore,
    RateLimits,
    RedisOptions,
    RedisStore,
    ResilientStore,
    StoreMisconfigured,
    open_store,
    redis_store as redis_store_module,
)
from gateway.state.redis_store import NUM_SESSION_SHARDS, session_keys
from tests.gateway.state.conftest import redis_options
from tests.support.redis_cluster_proc import RedisClusterProc
from tests.support.redis_proc import RedisProc

DAY_S = 86_400.0


def _prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


async def test_a_plain_url_at_a_cluster_node_uses_the_cluster(redis_cluster_session: RedisClusterProc) -> None:
    store = RedisStore(redis_options(redis_cluster_session.url, _prefix()))
    try:
        assert store.is_cluster is None                 # nothing decided before the first contact
        await store.connect()
        assert store.is_cluster is True
        limits = RateLimits(3, None, window_s=DAY_S)
        # Keys on every master (one per key id, spread by slot): each limit holds exactly.
        for key_id in (f"key-{i}" for i in range(12)):
            assert [(await store.rate_limit(key_id, limits, 0)).allowed for _ in range(4)] == [True] * 3 + [False]
    finally:
        await store.close()


async def test_a_node_list_url_names_the_cluster(redis_cluster_session: RedisClusterProc) -> None:
    dead = RedisProc()                                  # a start-up node that does not answer comes first
    url = redis_cluster_session.cluster_url.replace("://", f"://127.0.0.1:{dead.port},", 1)
    store = RedisStore(redis_options(url, _prefix()))
    try:
        await store.set_session("m\x00s", "http://a:1", ttl_s=30)
        assert store.is_cluster is True and await store.get_session("m\x00s") == "http://a:1"
    finally:
        await store.close()
        dead.stop()


async def test_a_cluster_url_at_a_plain_server_is_refused(redis_server: RedisProc) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_server.port}"
    store = RedisStore(RedisOptions(url=url))
    with pytest.raises(StoreMisconfigured, match="not in cluster mode"):
        await store.connect()
    with pytest.raises(StoreMisconfigured):            # a call does not degrade to in-process state either
        await ResilientStore(store, MemoryStore()).rate_limit("k", RateLimits(1, None), 0)
    with pytest.raises(StoreMisconfigured):            # what the gateway's start-up calls
        await open_store(url)
    await store.close()


async def test_a_redirection_switches_to_the_cluster_client_and_never_degrades(
        redis_cluster_session: RedisClusterProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """As with a server that refuses INFO: the store starts on a plain client at one node; the first key that
    lives on another master is answered MOVED, and the store switches to the cluster client for it and for
    every later call. Before this, the MOVED was an "outage": each gateway fell back to its own limits."""
    async def says_plain(client: object) -> bool:
        return False

    monkeypatch.setattr(redis_store_module, "is_cluster_node", says_plain)
    prefix = _prefix()
    replicas = [ResilientStore(RedisStore(redis_options(redis_cluster_session.url, prefix)),
                               MemoryStore()) for _ in range(2)]
    limits = RateLimits(10, None, window_s=DAY_S)
    try:
        # 16 checks on two replicas under one limit of 10: exactly 10 pass, wherever the key's slot is (six
        # keys: at least one lives on a master other than the node the URL names).
        for key_id in (f"shared-{i}" for i in range(6)):
            decisions = [await replicas[i % 2].rate_limit(key_id, limits, 0) for i in range(16)]
            assert sum(d.allowed for d in decisions) == 10
        assert not any(replica.degraded for replica in replicas)
        assert all(isinstance(replica.primary, RedisStore) and replica.primary.is_cluster for replica in replicas)
    finally:
        for replica in replicas:
            await replica.close()


def test_sessions_spread_over_index_shards_with_one_hash_tag_each() -> None:
    shards = set()
    for i in range(200):
        session, index = session_keys("switchyard:", f"m\x00agent-{i}")
        tag = index[index.index("{"):index.index("}") + 1]
        assert session.startswith("switchyard:session:" + tag)   # the key and its shard share the slot
        shards.add(tag)
    assert len(shards) == NUM_SESSION_SHARDS
