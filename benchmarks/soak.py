"""Soak: a long steady load through the gateway, then a shorter one to real workers, watching for leaks.

Phase 1 sends mixed streaming and non-streaming chat requests (Poisson arrivals at `--rate`, half
with one of 500 `x-session-affinity` keys, all with an API key whose limits live in Redis) through a
gateway on Redis to two fake upstreams. Phase 2 does the same at a lower rate to a real worker on the
bundled model. Each phase samples the gateway's RSS, open file descriptors and asyncio tasks (its
/metrics) and the Redis key count every second, and prints the median over the first window after the
warm-up (a minute, or a fifth of a short phase) and over the last window, with the growth between:
medians, because descriptors and tasks follow the requests in flight, which swing with Poisson arrivals,
and two single samples would measure that swing rather than a leak. Pools fill to the load's burst peaks
(clients' keep-alive connections, each with a handler task; Redis' pool; the upstream pool) and sessions to
the keys clients send: bounded, so the gateway's connections are counted from /proc and the verdict judges
what is left beside them (other fds, other tasks, Redis keys other than sessions). After the load, the task
count must fall back to what an idle gateway holds.

    .venv/bin/python benchmarks/soak.py [--duration-s 600 --rate 200] [--worker-duration-s 60 --worker-rate 2]
    .venv/bin/python benchmarks/soak.py --duration-s 20 --rate 50 --no-workers   # quick look
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gateway.ops.supervisor import wait_healthy  # noqa: E402
from gateway.state.redis_store import NUM_SESSION_SHARDS  # noqa: E402
from gateway_bench_load import MODEL, run_upstream, wait_http  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

API_KEY = "sk-soak"
NUM_SESSIONS = 500
SAMPLE_EVERY_S = 1.0
WINDOW_S = 60.0          # each compared window (at most a fifth of the phase)


@dataclass
class Sample:
    at_s: float          # seconds since the load started
    rss_mb: float        # gateway resident set size
    open_fds: float      # gateway open file descriptors (a median may end in .5)
    tasks: float         # gateway asyncio tasks alive
    redis_keys: float    # DBSIZE
    sessions: float = 0.0      # live sessions (the gateway's session index), part of redis_keys
    connections: float = 0.0   # the gateway's TCP connections (clients', Redis', upstreams'), part of open_fds
    client_connections: float = 0.0   # of them the clients': aiohttp runs one handler task for each


@dataclass
class Tally:
    num_ok: int = 0
    num_errors: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latency_ms: list[float] = field(default_factory=list)


# --- processes -----------------------------------------------------------------------------------

def start_redis(workdir: Path) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make test installs it; or apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    return proc, port


def start_gateway(workdir: Path, providers: dict, model: str, redis_port: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "redis_url": f"redis://127.0.0.1:{redis_port}/0",
        "api_keys": [{"key_id": "soak", "key": API_KEY, "max_requests_per_min": 10_000_000,
                      "max_tokens_per_min": 10_000_000_000, "admin": True}],
        "models": {model: {"providers": list(providers), "policy": {"name": "session_affinity"}}},
        "providers": providers,
        "log_level": "WARNING",
    }
    path = workdir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / f"gateway-{port}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--config", str(path)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url + "/ready", "gateway", 120)
    return proc, url


def start_worker(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (workdir / f"worker-{port}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "backends.server", "--port", str(port), "--max-num-seqs", "16"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url + "/health", "worker", 600)
    return proc, url


# --- sampling ------------------------------------------------------------------------------------

async def _num_sessions(redis) -> int:
    """Live sessions: the gateway's session index, one sorted set per shard (gateway/state/redis_store.py)."""
    return sum([await redis.zcard(f"switchyard:sessions:{{{shard}}}") for shard in range(NUM_SESSION_SHARDS)])


async def sample(client, gateway_url: str, redis, started: float, pid: int | None = None) -> Sample:
    async with client.get(gateway_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        text = await response.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    num_connections, num_clients = connections(pid, int(gateway_url.rsplit(":", 1)[1])) if pid else (0, 0)
    return Sample(at_s=time.monotonic() - started, rss_mb=values["process_resident_memory_bytes"] / 2**20,
                  open_fds=int(values["process_open_fds"]), tasks=int(values["switchyard_asyncio_tasks"]),
                  redis_keys=await redis.dbsize(), sessions=await _num_sessions(redis),
                  connections=num_connections, client_connections=num_clients)


def connections(pid: int, listen_port: int) -> tuple[int, int]:
    """(connected TCP sockets, those accepted on `listen_port`) of process `pid`, from /proc (Linux)."""
    peers = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                local_port, remote_port = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                if remote_port:
                    peers[fields[9]] = local_port    # inode -> local port
    num, num_clients = 0, 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        local_port = peers.get(target[8:-1]) if target.startswith("socket:[") else None
        if local_port is not None:
            num += 1
            num_clients += local_port == listen_port
    return num, num_clients


# --- load ----------------------------------------------------------------------------------------

def request_body(model: str, rng: random.Random, max_tokens: int) -> tuple[dict, bool]:
    stream = rng.random() < 0.5
    body = {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": f"Tell me about switchyard number {rng.randrange(10_000)}."}]}
    return body, stream


async def one(client, url: str, body: dict, stream: bool, headers: dict, tally: Tally) -> None:
    started = time.perf_counter()
    try:
        async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
            data = await response.read()
            done = not stream or data.rstrip().endswith(b"data: [DONE]")
            if response.status == 200 and done:
                tally.num_ok += 1
                tally.latency_ms.append((time.perf_counter() - started) * 1e3)
                return
            cause = f"status {response.status}" if response.status != 200 else "stream without [DONE]"
    except Exception as exc:  # noqa: BLE001  (a load generator counts every failure, whatever it is)
        cause = type(exc).__name__
    tally.num_errors += 1
    tally.errors[cause] = tally.errors.get(cause, 0) + 1


async def run_phase(name: str, gateway_url: str, model: str, redis_port: int, rate: float, duration_s: float,
                    max_tokens: int, seed: int, gateway_pid: int | None = None) -> dict:
    """`gateway_pid` (Linux): also count the gateway's connections, to tell pools filling from a leak."""
    import aiohttp
    import redis.asyncio as aioredis

    rng = random.Random(seed)
    tally = Tally()
    samples: list[Sample] = []
    redis = aioredis.Redis(port=redis_port)
    # One connection for the samples, the load on its own pool: closing the pool after the load lets
    # the gateway's per-connection tasks and sockets go, so "after load" compares with "idle".
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as probe:
        idle = await sample(probe, gateway_url, redis, time.monotonic(), gateway_pid)
        started = time.monotonic()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            in_flight: set[asyncio.Task] = set()
            next_sample = started + SAMPLE_EVERY_S
            next_send = started
            while (now := time.monotonic()) < started + duration_s:
                if now >= next_sample:
                    samples.append(await sample(probe, gateway_url, redis, started, gateway_pid))
                    next_sample += SAMPLE_EVERY_S
                if now < next_send:
                    await asyncio.sleep(min(next_send, next_sample) - now)
                    continue
                body, stream = request_body(model, rng, max_tokens)
                headers = {"Authorization": f"Bearer {API_KEY}"}
                if rng.random() < 0.5:
                    headers["x-session-affinity"] = f"session-{rng.randrange(NUM_SESSIONS)}"
                task = asyncio.create_task(one(client, gateway_url, body, stream, headers, tally))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                next_send += rng.expovariate(rate)
            samples.append(await sample(probe, gateway_url, redis, started, gateway_pid))
            if in_flight:
                await asyncio.wait(in_flight, timeout=120)
        # Connections close, background work (settling) winds down. Each figure's lowest over these samples:
        # a scrape can land while the periodic sharers are mid round trip to Redis (a task of theirs and one
        # of redis-py's, more often on a loaded machine); a leak is there in every sample.
        settling = [await sample(probe, gateway_url, redis, started, gateway_pid)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (lowest(settling).tasks <= idle.tasks
                                                   and lowest(settling).open_fds <= idle.open_fds):
            await asyncio.sleep(0.5)
            settling.append(await sample(probe, gateway_url, redis, started, gateway_pid))
        settled = lowest(settling)
    key_kinds: dict[str, int] = {}
    async for key in redis.scan_iter(count=1000):
        kind = key.decode(errors="replace").split(":")[:2]
        key_kinds[":".join(kind)] = key_kinds.get(":".join(kind), 0) + 1
    await redis.aclose()
    window_s = min(WINDOW_S, duration_s * 0.2)
    warm = window_median(samples, window_s, 2 * window_s)          # the first window after a window's warm-up
    end = window_median(samples, duration_s - window_s, duration_s + 1)
    return {"name": name, "rate": rate, "duration_s": duration_s, "tally": tally, "idle": idle, "warm": warm,
            "end": end, "settled": settled,
            "key_kinds": dict(sorted(key_kinds.items(), key=lambda kv: -kv[1])[:8])}


_FIGURES = ("rss_mb", "open_fds", "tasks", "redis_keys", "sessions", "connections", "client_connections")


def lowest(samples: list[Sample]) -> Sample:
    """Each figure's minimum over `samples` (at the last one's time)."""
    return Sample(samples[-1].at_s, *(min(getattr(s, name) for s in samples) for name in _FIGURES))


def window_median(samples: list[Sample], start_s: float, end_s: float) -> Sample:
    """Each figure's median over the samples taken in [start_s, end_s)."""
    inside = [s for s in samples if start_s <= s.at_s < end_s] or samples[-1:]
    return Sample(start_s, *(statistics.median(getattr(s, name) for s in inside) for name in _FIGURES))


def growth(before: float, after: float) -> str:
    return f"{(after / before - 1) * 100:+.1f}%" if before else "n/a"


def report(result: dict) -> bool:
    tally: Tally = result["tally"]
    warm, end, idle, settled = result["warm"], result["end"], result["idle"], result["settled"]
    sent = tally.num_ok + tally.num_errors
    lat = sorted(tally.latency_ms) or [0.0]
    print(f"\n## {result['name']}: {sent} requests in {result['duration_s']:.0f} s "
          f"({sent / result['duration_s']:.0f}/s offered {result['rate']:.0f}/s), {tally.num_errors} errors "
          f"{tally.errors or ''}; latency p50 {statistics.median(lat):.1f} ms, "
          f"p99 {lat[int(0.99 * (len(lat) - 1))]:.1f} ms")
    print(f"{'':14}{'idle':>10}{'first win':>10}{'last win':>10}{'growth':>10}{'after load':>12}"
          f"   (window medians: {warm.at_s:.0f} s on / the last {result['duration_s'] - end.at_s:.0f} s)")
    ok = tally.num_errors == 0
    # Pools fill to the load's burst peaks (clients' keep-alive connections with a handler task each, Redis'
    # and the upstreams' pools) and sessions to the keys clients send: bounded, so the verdict reads what is
    # left beside them. Without the connection counts (no pid) it reads the raw figures.
    counted = warm.connections > 0
    rows = [("RSS (MB)", lambda s: s.rss_mb, True), ("open fds", lambda s: s.open_fds, not counted),
            ("  connections", lambda s: s.connections, False),
            ("  other fds", lambda s: s.open_fds - s.connections, counted),
            ("asyncio tasks", lambda s: s.tasks, not counted),
            ("  other tasks", lambda s: s.tasks - s.client_connections, counted),
            ("Redis keys", lambda s: s.redis_keys, False), ("  sessions", lambda s: s.sessions, False),
            ("  other keys", lambda s: s.redis_keys - s.sessions, True)]
    for label, figure, judged in rows:
        if label.startswith("  ") and not counted and "keys" not in label:
            continue
        w, e = figure(warm), figure(end)
        print(f"{label:14}{figure(idle):>10.1f}{w:>10.1f}{e:>10.1f}{growth(w, e):>10}{figure(settled):>12.1f}"
              f"{'' if judged else '   (not judged)'}")
        # Counts move by whole units with the requests in flight (at 2 requests/s, a median of 7.5 tasks then
        # 8): growth must pass 5% and one unit to be a leak. RSS is judged by the 5% alone.
        slack = 0.0 if label == "RSS (MB)" else 1.0
        if judged and w and (e / w - 1) * 100 > 5.0 and e - w > slack:
            ok = False
    ok = ok and settled.tasks <= idle.tasks
    print(f"Redis keys by kind at the end: {result['key_kinds']}")
    print("(open fds after the load include the gateway's pooled upstream connections)")
    ok = ok and end.sessions <= NUM_SESSIONS * 2      # two models' sessions at most (the two phases)
    print(f"target (median growth under 5%, and one unit for counts, after warm-up of what is not a bounded pool; "
          f"zero errors; tasks back to idle; sessions within the keys sent): {'met' if ok else 'NOT met'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s to the fake upstreams")
    parser.add_argument("--worker-duration-s", type=float, default=60.0)
    parser.add_argument("--worker-rate", type=float, default=2.0, help="requests/s to the real worker")
    parser.add_argument("--no-workers", action="store_true", help="skip the real-worker phase")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import uvloop

    workdir = Path(tempfile.mkdtemp(prefix="switchyard-soak-"))
    procs: list = []
    ok = True
    try:
        redis_proc, redis_port = start_redis(workdir)
        procs.append(redis_proc)
        ports = [free_port(), free_port()]
        for port in ports:
            upstream = multiprocessing.Process(target=run_upstream, args=(port, 0.002), daemon=True)
            upstream.start()
            procs.append(upstream)
            wait_http(f"http://127.0.0.1:{port}/health", 30)
        providers = {"fakes": {"kind": "openai", "endpoints": [f"http://127.0.0.1:{p}" for p in ports]}}
        gateway, url = start_gateway(workdir, providers, MODEL, redis_port)
        procs.append(gateway)
        print(f"gateway pid {gateway.pid}, Redis on {redis_port}, logs in {workdir}; "
              f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
        ok &= report(uvloop.run(run_phase("fake upstreams", url, MODEL, redis_port, args.rate, args.duration_s,
                                          16, args.seed, gateway.pid)))
        if not args.no_workers:
            worker, worker_url = start_worker(workdir)
            procs.append(worker)
            providers = {"workers": {"kind": "openai", "endpoints": [worker_url], "offers_load": True,
                                     "offers_kv_events": True}}
            gateway2, url2 = start_gateway(workdir, providers, "smollm2", redis_port)
            procs.append(gateway2)
            ok &= report(uvloop.run(run_phase("real worker", url2, "smollm2", redis_port, args.worker_rate,
                                              args.worker_duration_s, 16, args.seed + 1, gateway2.pid)))
    finally:
        for proc in reversed(procs):
            proc.terminate() if isinstance(proc, subprocess.Popen) else proc.kill()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
