"""Which redis-py client `RedisStore` talks through: a plain `Redis`, redis-py's `RedisCluster`, or a `Redis` on
the master that Redis Sentinel names.

`redis://` and `rediss://` name one server; when that server is a cluster node (INFO's `cluster_enabled:1`)
the cluster client is used, so a node's address is enough. `redis+cluster://` (`rediss+cluster://`) names a
cluster by one or more comma-separated start-up nodes and refuses a server that is not one.
`redis+sentinel://[user:password@]h1:p1,h2:p2/SERVICE[/DB]` (`rediss+sentinel://`) names the sentinels that watch
a master (SERVICE, their `sentinel monitor` name): every connection asks them where the master is, so after a
failover the next connection reaches the promoted replica. Owns no keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from urllib.parse import unquote, urlsplit

from redis import asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

Client = aioredis.Redis | RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}


class StoreMisconfigured(Exception):
    """The Redis named in the config is not what the config says (a cluster URL at a plain server): not an
    outage, so it is never answered from the in-process store; the gateway refuses to start on it."""


class Topology(str, Enum):
    AUTO = "auto"          # redis:// or rediss://: ask the server whether it is a cluster node
    CLUSTER = "cluster"    # redis+cluster://: a cluster, or an error
    SENTINEL = "sentinel"  # redis+sentinel://: the master the sentinels name


@dataclass(frozen=True, slots=True)
class RedisOptions:
    url: str                              # redis://, rediss://, redis+cluster://h1:p1,h2:p2, rediss+cluster://,
                                          # redis+sentinel://h1:p1,h2:p2/SERVICE or rediss+sentinel://
    key_prefix: str = "switchyard:"       # namespaces every key (several deployments may share a Redis)
    socket_timeout_s: float = 0.25        # per read/write; an outage is detected this fast
    connect_timeout_s: float = 0.25       # TCP connect
    max_connections: int = 64             # pool size (per node on a cluster)
    pool_timeout_s: float = 1.0           # wait this long for a free pooled connection (plain server)
    num_retries: int = 1                  # immediate retries on a fresh connection (stale pool after a restart)


def topology(url: str) -> Topology:
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        return Topology.CLUSTER
    return Topology.SENTINEL if scheme in SENTINEL_SCHEMES else Topology.AUTO


def plain_client(options: RedisOptions) -> aioredis.Redis:
    # A blocking pool: a burst beyond max_connections waits briefly instead of failing as an "outage".
    pool = aioredis.BlockingConnectionPool.from_url(
        options.url, max_connections=options.max_connections, timeout=options.pool_timeout_s,
        socket_timeout=options.socket_timeout_s, socket_connect_timeout=options.connect_timeout_s,
        retry=Retry(NoBackoff(), options.num_retries), decode_responses=True)
    return aioredis.Redis.from_pool(pool)


def cluster_client(options: RedisOptions) -> RedisCluster:
    """redis-py's cluster client over the URL's nodes. It follows MOVED and ASK itself and refreshes its slot
    map after a failover; its own retries are kept to `num_retries`, without backoff, so that an unserved
    slot surfaces as an outage as fast as a dead server does."""
    parts = urlsplit(options.url)
    secure = CLUSTER_SCHEMES.get(parts.scheme, parts.scheme) == "rediss"
    hosts = parts.netloc.rpartition("@")[2]
    nodes = [_node(address) for address in hosts.split(",") if address]
    if not nodes:
        raise StoreMisconfigured(f"redis cluster URL names no node: {_redacted(options.url)}")
    if parts.path.strip("/") not in ("", "0"):
        raise StoreMisconfigured(f"a redis cluster has only database 0: {_redacted(options.url)}")
    return RedisCluster(
        startup_nodes=nodes, username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None, ssl=secure,
        socket_timeout=options.socket_timeout_s, socket_connect_timeout=options.connect_timeout_s,
        max_connections=options.max_connections, retry=Retry(NoBackoff(), options.num_retries),
        decode_responses=True)


def sentinel_client(options: RedisOptions) -> aioredis.Redis:
    """A client of the master that the URL's sentinels name (redis-py's Sentinel): a connection asks them for the
    master's address when it opens, and one that meets a demoted master (READONLY) is closed, so a failover is an
    outage until the promoted replica answers, then served by it. Sentinels that do not answer are skipped."""
    parts = urlsplit(options.url)
    service, _, db = parts.path.strip("/").partition("/")
    if not service or not (db or "0").isdigit():
        raise StoreMisconfigured(f"redis sentinel URL wants /SERVICE[/DB] after its sentinels: "
                                 f"{_redacted(options.url)}")
    addresses = [_address(address) for address in parts.netloc.rpartition("@")[2].split(",") if address]
    if not addresses:
        raise StoreMisconfigured(f"redis sentinel URL names no sentinel: {_redacted(options.url)}")
    sentinels = Sentinel(
        addresses, sentinel_kwargs={"socket_timeout": options.socket_timeout_s,
                                    "socket_connect_timeout": options.connect_timeout_s},
        ssl=SENTINEL_SCHEMES[parts.scheme] == "rediss", username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None, db=int(db or 0),
        socket_timeout=options.socket_timeout_s, socket_connect_timeout=options.connect_timeout_s,
        retry=Retry(NoBackoff(), options.num_retries), decode_responses=True)
    return sentinels.master_for(service)


async def is_cluster_node(client: aioredis.Redis) -> bool:
    """True if the server runs in cluster mode. A server that refuses INFO (some managed ones rename it) counts
    as plain; its first MOVED still switches the store to the cluster client."""
    try:
        info = await client.info("cluster")
    except ResponseError:
        return False
    return bool(int(info.get("cluster_enabled", 0)))


def node_urls(url: str) -> list[str]:
    """A plain URL per start-up node of a cluster URL (the URL itself when it names one server)."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        return [url]
    userinfo, _, hosts = parts.netloc.rpartition("@")
    auth = f"{userinfo}@" if userinfo else ""
    return [f"{CLUSTER_SCHEMES[parts.scheme]}://{auth}{host}/0" for host in hosts.split(",") if host]


def as_cluster_url(url: str) -> str:
    """The redis+cluster:// form of a plain URL that turned out to name a cluster node."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}+cluster://{rest}" if scheme in ("redis", "rediss") else url


def _node(address: str) -> ClusterNode:
    return ClusterNode(*_address(address))


def _address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise StoreMisconfigured(f"redis node {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    return url.replace(parts.password, "***") if parts.password else url
