"""Endpoints found in DNS (`dns+http://NAME:PORT`, gateway/config/discovery.py): a real gateway process resolving a
real name, and the registry following a name whose addresses change (a resolver the test controls stands in
for a DNS server, the one part that cannot run here) in front of fake upstreams that share one port on
several loopback addresses, as a service's replicas do."""
from __future__ import annotations

import urllib.request
from typing import Any

import aiohttp
import orjson
import pytest

from cache.prefix_index import PrefixIndex
from gateway.config.discovery import DnsName
from gateway.config.gateway_config import ConfigError, Pool, parse_config
from gateway.routing.endpoints import UpstreamRegistry
from gateway.routing.load import LoadTracker
from tests.gateway.conftest import gateway_config
from tests.support.fake_upstream import FakeUpstream
from tests.support.ports import free_port
from tests.support.wait import await_until, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_a_gateway_serves_through_the_addresses_a_name_resolves_to(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("e0")
    gateway = start_gateway(gateway_config({"p": [f"dns+http://localhost:{fake.port}"]}))   # 127.0.0.1 here
    request = urllib.request.Request(gateway.url + "/v1/chat/completions", data=orjson.dumps(CHAT),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert orjson.loads(response.read())["served_by"] == "e0"

    def listed() -> list[str] | None:
        with urllib.request.urlopen(gateway.url + "/status.json", timeout=5) as response:
            ids = [e["id"] for e in orjson.loads(response.read())["endpoints"]]
        return ids if fake.url in ids else None
    assert fake.url in wait_until(listed, "the discovered endpoint on the status page")


@pytest.mark.parametrize("url", ["dns+https://w:8000", "dns+http://w:8000/v1", "dns+http://:8000"])
def test_what_a_dns_entry_may_not_be(url: str) -> None:
    with pytest.raises(ConfigError, match=r"providers\.p\.endpoints"):
        parse_config(f'models: {{m: {{providers: [p]}}}}\nproviders: {{p: {{endpoints: ["{url}"]}}}}', {})
    assert DnsName.parse("dns+http://workers.svc:8000") == DnsName("workers.svc", 8000)
    assert DnsName("w", 80).endpoint_url("fd00::1") == "http://[fd00::1]:80"


async def test_the_registry_follows_a_name_whose_addresses_change() -> None:
    """Replicas appear and go: each new address is an endpoint with its pollers (health checks reach it),
    one that went is retired with what the gateway knew of it, and a failed lookup changes nothing."""
    port = free_port()
    replicas = {address: FakeUpstream(f"r{i}", host=address, port=port)
                for i, address in enumerate(["127.0.0.2", "127.0.0.3"])}
    try:
        answers: dict[str, Any] = {"addresses": ["127.0.0.2"]}

        async def resolver(host: str, port_: int) -> list[str]:
            assert (host, port_) == ("workers", port)
            if answers["addresses"] is None:
                raise OSError("lookup failed")
            return list(answers["addresses"])

        config = parse_config(orjson.dumps(gateway_config(
            {"p": [f"dns+http://workers:{port}"]}, pollers={"health_interval_s": 0.05})).decode(), {})
        tracker, index = LoadTracker(), PrefixIndex()
        registry = UpstreamRegistry(config, tracker, index, resolver=resolver)
        (discovery,) = registry.discoveries
        r0, r1 = (replica.url for replica in replicas.values())

        def pool() -> list[str]:
            return [e.endpoint_id for e in registry.pool("p", Pool.MAIN)]

        async with aiohttp.ClientSession() as session:
            registry.start(session)
            try:
                await await_until(lambda: pool() == [r0], "the first replica found")
                await await_until(lambda: registry.endpoints[r0].health_checked, "its health checked")
                index.record_routed(r0, [1, 2, 3])   # approximate: the fakes publish no KV events
                assert index.num_blocks(r0) == 3
                answers["addresses"] = ["127.0.0.2", "127.0.0.3"]
                await discovery.refresh()
                assert pool() == [r0, r1]
                await await_until(lambda: registry.endpoints[r1].health_checked, "the new replica's health checked")
                answers["addresses"] = None                    # DNS down: the pool stays as it was
                await discovery.refresh()
                assert pool() == [r0, r1]
                answers["addresses"] = ["127.0.0.3"]
                await discovery.refresh()
                assert pool() == [r1] and r0 not in registry.endpoints
                assert index.num_blocks(r0) == 0 and r0 not in tracker.endpoint_ids()
                assert r0 not in registry._polled    # its pollers were stopped
            finally:
                await registry.stop()
    finally:
        for replica in replicas.values():
            replica.stop()


async def test_an_address_stays_while_any_entry_or_static_url_lists_it() -> None:
    """Two DNS entries and a static URL in one pool: an address is listed once, and goes only when nothing lists
    it (no pollers here: the registry is not started)."""
    names = {"a": ["127.0.0.1", "127.0.0.9"], "b": ["127.0.0.1"]}

    async def resolver(host: str, port: int) -> list[str]:
        return names[host]

    config = parse_config(orjson.dumps(gateway_config({"p": ["http://127.0.0.9:80", "dns+http://a:80",
                                                              "dns+http://b:80"]})).decode(), {})
    registry = UpstreamRegistry(config, LoadTracker(), PrefixIndex(), resolver=resolver)
    a, b = registry.discoveries

    def pool() -> list[str]:
        return [e.endpoint_id for e in registry.pool("p", Pool.MAIN)]

    await a.refresh()
    await b.refresh()
    assert pool() == ["http://127.0.0.9:80", "http://127.0.0.1:80"]
    names["a"] = []
    await a.refresh()                      # b still names .1; .9 is a static URL
    assert pool() == ["http://127.0.0.9:80", "http://127.0.0.1:80"]
    names["b"] = []
    await b.refresh()
    assert pool() == ["http://127.0.0.9:80"] and "http://127.0.0.1:80" not in registry.endpoints
