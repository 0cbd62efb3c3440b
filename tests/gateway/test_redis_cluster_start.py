"""What a gateway makes of its `redis_url` at start-up: a cluster URL at a plain server stops it with a clear
error (a misconfiguration is not an outage), a URL of another scheme is a config error, and a plain URL at a
cluster node starts on the cluster (its shared limits: tests/gateway/test_limits.py)."""
from __future__ import annotations

import pytest

from gateway.config.gateway_config import ConfigError, parse_config
from tests.gateway.conftest import gateway_config
from tests.support.redis_cluster_proc import RedisClusterProc
from tests.support.redis_proc import RedisProc

MINIMAL = "models: {m: {providers: [p]}}\nproviders: {p: {endpoints: ['http://h:1']}}\n"


def test_redis_url_schemes() -> None:
    for url in ("redis://h:6379/0", "rediss://u:p@h:6380", "redis+cluster://a:7000,b:7000", "unix:///run/r.sock"):
        assert parse_config(MINIMAL + f"redis_url: '{url}'\n", {}).redis_url == url
    with pytest.raises(ConfigError, match=r"redis_url: expected one of redis://.*got 'h:6379'"):
        parse_config(MINIMAL + "redis_url: 'h:6379'\n", {})


def test_a_cluster_url_at_a_plain_server_stops_the_gateway(start_fakes, start_gateway, redis_server: RedisProc) -> None:
    (fake,) = start_fakes("a")
    config = gateway_config({"p": [fake.url]}, redis_url=f"redis+cluster://127.0.0.1:{redis_server.port}")
    with pytest.raises(RuntimeError, match=r"gateway exited with 1") as failed:
        start_gateway(config)
    assert f"redis_url: redis_url names a cluster, but redis://127.0.0.1:{redis_server.port}/0 is not in cluster " \
           "mode" in str(failed.value)


def test_a_plain_url_at_a_cluster_node_starts_on_the_cluster(start_fakes, start_gateway,
                                                            redis_cluster_session: RedisClusterProc) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway({**gateway_config({"p": [fake.url]}, redis_url=redis_cluster_session.url),
                             "log_level": "INFO"})
    assert "is a cluster node: sharing state through the cluster" in gateway.log()
