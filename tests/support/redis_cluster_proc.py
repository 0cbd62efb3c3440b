"""A real Redis Cluster for tests: `redis-server --cluster-enabled yes` nodes on free ports (and bus ports),
joined by `redis-cli --cluster create --cluster-replicas 1`, started and awaited until every node reports
`cluster_state:ok`; masters can be killed to stage a failover. Plus the fixtures that hand it to tests.
"""
from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import pytest

from tests.support.ports import free_cluster_port
from tests.support.redis_proc import RedisProc
from tests.support.wait import wait_until


@dataclass(frozen=True, slots=True)
class ClusterNodeInfo:
    node_id: str              # the cluster's id of the node
    port: int                 # the node's client port
    master_id: str | None     # a replica's master; None for a master
    is_master: bool           # serves slots now (after a failover: the promoted replica)
    is_failed: bool           # marked fail by the others (killed, or cut off)


class RedisClusterProc:
    """`with RedisClusterProc() as cluster: cluster.url` — 3 masters and 3 replicas by default."""

    def __init__(self, num_masters: int = 3, *, host: str = "127.0.0.1", node_timeout_ms: int = 1000,
                 wrapper: Sequence[str] = (), ports: Sequence[int] | None = None) -> None:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed (apt-get install -y redis-server)")
        num_nodes = num_masters * 2
        ports = list(ports) if ports is not None else [free_cluster_port() for _ in range(num_nodes)]
        # A short node timeout makes a failover take about a second; validity factor 0: a replica always
        # takes over, however long it was cut off from its master.
        options = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                   "--cluster-replica-validity-factor", "0", "--cluster-config-file", "nodes.conf")
        self.host = host
        self.nodes = [RedisProc(port, host=host, extra_args=options, wrapper=wrapper) for port in ports]
        self._num_masters = num_masters

    @property
    def url(self) -> str:
        """A plain URL at one node: the gateway finds out that it is a cluster."""
        return self.nodes[0].url

    @property
    def cluster_url(self) -> str:
        """The explicit form, with every master as a start-up node."""
        return "redis+cluster://" + ",".join(f"{self.host}:{n.port}" for n in self.nodes[:self._num_masters])

    def start(self) -> RedisClusterProc:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"{self.host}:{node.port}" for node in self.nodes]
            self.nodes[0].cli("--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes",
                              timeout_s=60.0)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every running node says cluster_state:ok and agrees that the masters are up and cover the slots,
        and every live replica's link to its master is up (synced: what it would take over is there)."""
        def ok() -> bool:
            for node in self.live_nodes():
                if "cluster_state:ok" not in node.cli("CLUSTER", "INFO"):
                    return False
            rows = self.topology()
            masters = [n for n in rows if n.is_master and not n.is_failed]
            replicas = [self.node(n.port) for n in rows if not n.is_master and not n.is_failed]
            return len(masters) == self._num_masters and all(
                "master_link_status:up" in r.cli("INFO", "replication") for r in replicas if r.running)
        wait_until(ok, "every cluster node to report cluster_state:ok", timeout_s=timeout_s, interval_s=0.05)

    def live_nodes(self) -> list[RedisProc]:
        return [node for node in self.nodes if node.running]

    def topology(self) -> list[ClusterNodeInfo]:
        """CLUSTER NODES as one live node sees it."""
        rows = []
        for line in self.live_nodes()[0].cli("CLUSTER", "NODES").splitlines():
            fields = line.split()
            flags = fields[2].split(",")
            rows.append(ClusterNodeInfo(node_id=fields[0], port=int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                                        master_id=None if fields[3] == "-" else fields[3],
                                        is_master="master" in flags, is_failed="fail" in flags))
        return rows

    def masters(self) -> list[RedisProc]:
        serving = {n.port for n in self.topology() if n.is_master and not n.is_failed}
        return [node for node in self.live_nodes() if node.port in serving]

    def replica_of(self, master: RedisProc) -> RedisProc:
        rows = self.topology()
        master_id = next(row.node_id for row in rows if row.port == master.port)
        return self.node(next(row.port for row in rows if row.master_id == master_id))

    def node(self, port: int) -> RedisProc:
        return next(node for node in self.nodes if node.port == port)

    def master_of(self, key: str) -> RedisProc:
        """The live master that serves the key's slot."""
        slot = int(self.live_nodes()[0].cli("CLUSTER", "KEYSLOT", key))
        for node in self.masters():
            if any(low <= slot <= high for low, high in _own_slots(node)):
                return node
        raise AssertionError(f"no live master serves slot {slot}")

    def keys(self, pattern: str) -> list[str]:
        """KEYS on every master, together."""
        return sorted(key for node in self.masters() for key in node.cli("--scan", "--pattern", pattern).split())

    def flush(self) -> None:
        for node in self.masters():
            node.cli("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProc:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _own_slots(node: RedisProc) -> list[tuple[int, int]]:
    """The slot ranges the node itself serves, from its own CLUSTER NODES line (flag `myself`)."""
    for line in node.cli("CLUSTER", "NODES").splitlines():
        fields = line.split()
        if "myself" in fields[2].split(","):
            ranges = [field.split("-") for field in fields[8:] if not field.startswith("[")]
            return [(int(r[0]), int(r[-1])) for r in ranges]
    return []


@pytest.fixture(scope="session")
def redis_cluster_session() -> Iterator[RedisClusterProc]:
    """One cluster for the whole run (tests that only read and write share it; `shared_redis` flushes it)."""
    try:
        with RedisClusterProc() as cluster:
            yield cluster
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"redis cluster failed to start: {exc.stderr}") from exc


@pytest.fixture
def redis_cluster() -> Iterator[RedisClusterProc]:
    """A cluster of the test's own: for tests that kill its nodes."""
    with RedisClusterProc() as cluster:
        yield cluster


@dataclass(frozen=True, slots=True)
class SharedRedis:
    """What a two-replica test needs of its shared Redis, whichever kind it is."""
    kind: str                           # "server" or "cluster"
    url: str                            # what the gateways' redis_url says
    server: RedisProc | None            # the single server, or None
    cluster: RedisClusterProc | None    # the cluster, or None

    def keys(self, pattern: str) -> list[str]:
        if self.cluster is not None:
            return self.cluster.keys(pattern)
        assert self.server is not None
        return sorted(self.server.cli("--scan", "--pattern", pattern).split())


@pytest.fixture(params=["server", "cluster"])
def shared_redis(request: pytest.FixtureRequest) -> Iterator[SharedRedis]:
    """The tests that share state between gateway replicas run once on one redis-server and once on a
    3-master Redis Cluster that the gateways are pointed at by one node's plain redis:// URL."""
    if request.param == "server":
        with RedisProc() as server:
            yield SharedRedis("server", server.url, server, None)
        return
    cluster: RedisClusterProc = request.getfixturevalue("redis_cluster_session")
    cluster.flush()
    yield SharedRedis("cluster", cluster.url, None, cluster)
