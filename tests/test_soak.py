"""A short, bounded soak (benchmarks/soak.py's load, a few seconds of it): mixed streaming and
non-streaming requests with sessions and a Redis-backed API key through a real gateway to fake
upstreams. Nothing fails, every asyncio task the load created is gone afterwards, and Redis holds
only the bounded kinds of keys. The ten-minute run and its growth figures are in docs/reliability.md."""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402
from gateway.state.redis_store import NUM_SESSION_SHARDS  # noqa: E402


@pytest.fixture
def soak_setup(tmp_path):
    procs: list = []
    try:
        redis_proc, redis_port = soak.start_redis(tmp_path)
        procs.append(redis_proc)
        ports = [soak.free_port(), soak.free_port()]
        for port in ports:
            upstream = multiprocessing.Process(target=soak.run_upstream, args=(port, 0.001), daemon=True)
            upstream.start()
            procs.append(upstream)
            soak.wait_http(f"http://127.0.0.1:{port}/health", 30)
        providers = {"fakes": {"kind": "openai", "endpoints": [f"http://127.0.0.1:{p}" for p in ports]}}
        gateway, url = soak.start_gateway(tmp_path, providers, soak.MODEL, redis_port)
        procs.append(gateway)
        yield url, redis_port
    finally:
        for proc in reversed(procs):
            if isinstance(proc, subprocess.Popen):
                proc.terminate()
                proc.wait(10)
            else:
                proc.kill()


async def test_short_soak_loses_nothing_and_leaks_no_task(soak_setup) -> None:
    url, redis_port = soak_setup
    result = await soak.run_phase("fakes", url, soak.MODEL, redis_port, rate=40.0, duration_s=8.0,
                                  max_tokens=16, seed=1)
    tally = result["tally"]
    assert tally.num_ok > 100 and tally.num_errors == 0, tally.errors
    assert result["settled"].tasks <= result["idle"].tasks  # every request's tasks ended
    kinds = result["key_kinds"]
    assert set(kinds) <= {"switchyard:session", "switchyard:sessions", "switchyard:usage", "switchyard:rl",
                          "switchyard:inflight"}, kinds
    assert kinds["switchyard:session"] <= soak.NUM_SESSIONS
    # the live-session index: one sorted set per shard (gateway/state/redis_store.py)
    assert kinds.get("switchyard:sessions", 0) <= NUM_SESSION_SHARDS
