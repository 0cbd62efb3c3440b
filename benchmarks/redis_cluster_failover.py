"""How long a gateway's state store serves from its fallback when a Redis Cluster master dies, and what it misses.

A real 3-master cluster (tests/support/redis_cluster_proc.py); one `ResilientStore` over the cluster, as a
gateway holds it, takes rate-limit checks and usage records back to back; the master of the usage key is
SIGKILLed and its replica takes over by itself. Reported per run: the window (kill to the store back on the
cluster), the calls answered from the fallback in it, and the usage records the cluster missed.

    .venv/bin/python benchmarks/redis_cluster_failover.py --runs 3 --node-timeout-ms 1000
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from gateway.state import MemoryStore, RateLimits, RedisOptions, RedisStore, ResilientStore
from tests.support.redis_cluster_proc import RedisClusterProc

USAGE_KEY = "bench:usage:k"


async def one_run(cluster: RedisClusterProc) -> dict[str, float]:
    store = ResilientStore(RedisStore(RedisOptions(url=cluster.url, key_prefix="bench:")), MemoryStore(),
                           probe_interval_s=0.25)
    limits = RateLimits(10**9, None, window_s=60.0)
    num_calls = num_in_window = 0
    try:
        for _ in range(50):                               # warm: the script loaded, the slot map read
            await store.rate_limit("k", limits, 0)
            await store.record_usage("k", 1, 0, 1)
            num_calls += 1
        victim = cluster.master_of(USAGE_KEY)
        killed_at = time.monotonic()
        victim.kill()
        while True:
            await store.rate_limit("k", limits, 0)
            await store.record_usage("k", 1, 0, 1)
            num_calls += 1
            if store.degraded:
                num_in_window += 1
            elif num_in_window:                           # it was degraded and is back
                break
            await asyncio.sleep(0.001)
        window_s = time.monotonic() - killed_at
        await asyncio.to_thread(cluster.wait_ok)
        counted = int(cluster.master_of(USAGE_KEY).cli("HGET", USAGE_KEY, "requests").strip() or 0)
    finally:
        await store.close()
    return {"window_s": window_s, "calls": num_calls, "in_window": num_in_window, "missed": num_calls - counted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--node-timeout-ms", type=int, default=1000, help="cluster-node-timeout (Redis: 15000)")
    args = parser.parse_args()
    for run in range(args.runs):
        with RedisClusterProc(node_timeout_ms=args.node_timeout_ms) as cluster:
            result = asyncio.run(one_run(cluster))
        print(f"run {run}: node timeout {args.node_timeout_ms} ms: window {result['window_s']:.2f} s, "
              f"{result['in_window']} of {result['calls']} usage records made in it went to the fallback; "
              f"the cluster missed {result['missed']}", flush=True)


if __name__ == "__main__":
    main()
