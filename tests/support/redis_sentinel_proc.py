"""A real Redis Sentinel setup for tests: a master, its replica and one sentinel watching them (quorum 1, the master
called down after `down_after_ms` unanswered), each a `redis-server` (tests/support/redis_proc.py) on a free port.
`url` is the `redis+sentinel://` URL a gateway is given; killing the master makes the sentinel promote the
replica."""
from __future__ import annotations

from types import TracebackType

from tests.support.redis_proc import RedisProc
from tests.support.wait import wait_until

SERVICE = "switchyard"


class RedisSentinelProc:
    def __init__(self, down_after_ms: int = 500) -> None:
        """`down_after_ms`: short for a failover test; long where a loaded machine's stall must not start one."""
        self.master = RedisProc()
        self.replica = RedisProc(extra_args=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.sentinel = RedisProc(extra_args=("--sentinel",), config=(
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 1",
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
            f"sentinel failover-timeout {SERVICE} 5000"))

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}"

    def master_port(self) -> int:
        """The port of the master the sentinel names now."""
        return int(self.sentinel.cli("SENTINEL", "get-master-addr-by-name", SERVICE).split()[1])

    def start(self) -> RedisSentinelProc:
        """All three, once the replica is in sync and the sentinel knows it (it could not promote it before)."""
        self.master.start()
        self.replica.start()
        wait_until(lambda: "master_link_status:up" in self.replica.cli("INFO", "replication"), "the replica in sync",
                   timeout_s=20.0)
        self.sentinel.start()
        wait_until(lambda: str(self.replica.port) in self.sentinel.cli("SENTINEL", "replicas", SERVICE),
                   "the sentinel to find the replica", timeout_s=20.0)
        return self

    def stop(self) -> None:
        for proc in (self.sentinel, self.replica, self.master):
            proc.stop()

    def __enter__(self) -> RedisSentinelProc:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
