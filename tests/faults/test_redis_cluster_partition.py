"""A gateway host cut off from its Redis Cluster and joined again (issue 52 §1), with real hosts: two network
namespaces joined by a veth pair, the cluster's six nodes on one, a gateway, its upstream and its client (curl)
on the other. The partition is the gateway end of the link set down. Throughout, every request is answered;
while cut off, the gateway keeps its limits in-process; once joined, the cluster's state holds again.
Skipped where namespaces cannot be made (not root, no iproute2)."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import yaml

from tests.faults.load import BACK_LOG, OUTAGE_LOG
from tests.gateway.conftest import gateway_config
from tests.support import netns
from tests.support.fake_upstream import REPO_ROOT
from tests.support.netns import Host, TwoHosts
from tests.support.ports import free_port
from tests.support.redis_cluster_proc import RedisClusterProc
from tests.support.wait import wait_until

LOAD_KEY, LIMITED_KEY = "sk-load", "sk-limited"
MAX_LIMITED_PER_DAY = 3
USAGE_KEY = "switchyard:usage:load"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    pair = TwoHosts()
    with pair:
        yield pair


class NamespacedGateway:
    """A fake upstream and a gateway on `host`, both on its loopback, sharing state through `redis_url`."""

    def __init__(self, host: Host, redis_url: str, workdir: Path) -> None:
        self.host = host
        fake_port, port = free_port(), free_port()
        self._fake = subprocess.Popen(
            [*host.wrapper, sys.executable, "-m", "tests.support.fake_upstream", "--port", str(fake_port),
             "--host", "127.0.0.1", "--name", "a"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        keys = [{"key_id": "load", "key": LOAD_KEY},
                {"key_id": "limited", "key": LIMITED_KEY, "max_requests_per_min": MAX_LIMITED_PER_DAY}]
        config = gateway_config({"p": [f"http://127.0.0.1:{fake_port}"]}, redis_url=redis_url, api_keys=keys,
                                listen={"host": "127.0.0.1", "port": port}, log_level="INFO")
        config_path = workdir / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "gateway.log"
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [*host.wrapper, sys.executable, "-m", "gateway.cli", "gateway", "--config", str(config_path)],
                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        host.wait_http(f"http://127.0.0.1:{fake_port}/health", "the namespaced upstream to answer")
        host.wait_http(self.url + "/ready", "the namespaced gateway to be ready")

    def post(self, key: str) -> int:
        status, _ = self.host.http("POST", self.url + "/v1/chat/completions", BODY,
                                   headers=[f"Authorization: Bearer {key}"])
        return status

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        for proc in (self._proc, self._fake):
            proc.kill()
            proc.wait()


def _usage(cluster: RedisClusterProc) -> int:
    return int(cluster.master_of(USAGE_KEY).cli("HGET", USAGE_KEY, "requests").strip() or 0)


def test_a_gateway_host_loses_the_cluster_and_comes_back(hosts: TwoHosts, tmp_path: Path) -> None:
    with RedisClusterProc(host=TwoHosts.A_ADDRESS, wrapper=hosts.a.wrapper) as cluster:
        gateway = NamespacedGateway(hosts.b, cluster.url, tmp_path)
        try:
            limited = [gateway.post(LIMITED_KEY) for _ in range(MAX_LIMITED_PER_DAY + 1)]
            assert limited == [200] * MAX_LIMITED_PER_DAY + [429]         # the cluster's bucket
            assert gateway.post(LOAD_KEY) == 200
            wait_until(lambda: _usage(cluster) == 1, "the request's usage to be recorded in the cluster")

            hosts.cut()
            assert [gateway.post(LOAD_KEY) for _ in range(5)] == [200] * 5   # answered through the partition
            wait_until(lambda: OUTAGE_LOG in gateway.log(), "the gateway to see the partition")
            during = [gateway.post(LIMITED_KEY) for _ in range(MAX_LIMITED_PER_DAY + 1)]
            assert during == [200] * MAX_LIMITED_PER_DAY + [429]          # the gateway's own bucket meanwhile
            assert _usage(cluster) == 1                                   # the cluster saw none of it yet

            hosts.heal()
            wait_until(lambda: BACK_LOG in gateway.log(), "the gateway to return to the cluster")
            assert gateway.post(LIMITED_KEY) == 429                       # the cluster's bucket again
            assert gateway.post(LOAD_KEY) == 200
            counted = wait_until(lambda: _usage(cluster) >= 2 and _usage(cluster), "usage in the cluster again")
            # 2, and one more for each usage write that sat in a pooled connection's send buffer at the cut: its
            # reply timed out, so it went to the fallback as well, and TCP still delivers it once the link is back
            # (one in a run alone here, two beside a loaded machine's other tests). A write that timed out is in
            # doubt, never known to be lost; at most the partition's 5 requests are.
            assert 2 <= counted <= 2 + 5, counted
            assert gateway.log().count(OUTAGE_LOG) == 1
        finally:
            gateway.stop()
