"""The approximate prefix index shared between real gateway processes behind one Redis
(gateway/routing/prefix_share.py): a conversation routed by one process has its next turn follow its prefix in the
other, on one Redis server and on a Redis Cluster. The sharing itself, on both stores, is in
tests/gateway/state/test_prefix_share.py."""
from __future__ import annotations

import urllib.request

import aiohttp
import orjson

from tests.gateway.conftest import gateway_config, metric
from tests.gateway.test_prefix_routing import served_by
from tests.support.redis_cluster_proc import SharedRedis
from tests.support.wait import await_until


def endpoint_rows(gateway_url: str) -> dict[str, dict]:
    """The gateway's /status.json rows, by endpoint id."""
    with urllib.request.urlopen(gateway_url + "/status.json", timeout=5) as response:
        return {row["id"]: row for row in orjson.loads(response.read())["endpoints"]}


async def test_a_conversation_follows_its_prefix_across_gateway_processes(start_fakes, start_gateway,
                                                                         shared_redis: SharedRedis) -> None:
    fakes = start_fakes("a", "b", "c")
    config = gateway_config({"p": [f.url for f in fakes]}, policy="prefix_aware", redis_url=shared_redis.url)
    config["pollers"]["share_interval_s"] = 0.05
    first_process, second_process = start_gateway(config), start_gateway(config)
    # No common system prompt: the second process has never seen any of these prefixes, so a prefix hit
    # there can only come from the first process's decisions.
    conversations = [list(range(k * 100, k * 100 + 64)) for k in range(6)]
    async with aiohttp.ClientSession() as client:
        homes = [await served_by(client, first_process.url, c) for c in conversations]
        await await_until(lambda: metric(second_process, "switchyard_shared_routing_decisions_total") >= 6,
                          "the second process to apply the first one's decisions")

        def ready() -> bool:
            """Every endpoint healthy as the second process has checked it, indexing what the first one does (under
            load a health check may still be pending: an endpoint not yet checked healthy is not routed to)."""
            first, second = endpoint_rows(first_process.url), endpoint_rows(second_process.url)
            return all(row["healthy"] and row["health_checked"]
                       and row["num_indexed_blocks"] == first[key]["num_indexed_blocks"] for key, row in second.items())
        await await_until(ready, "the second process to see every endpoint healthy, with the shared blocks")
        hits_before = metric(second_process, "switchyard_routing_decisions_total", reason="prefix_hit")
        again = [await served_by(client, second_process.url, c + list(range(5000, 5032))) for c in conversations]
    assert again == homes                            # each next turn went where the other process sent its prefix
    assert metric(second_process, "switchyard_routing_decisions_total", reason="prefix_hit") - hits_before == 6
