"""Gateway overhead benchmark: the same load sent straight to a fast fake upstream and through the
gateway, side by side in one run. Closed loop (max requests/s at a fixed concurrency, non-streaming)
and open loop (Poisson arrivals at fixed rates, streaming 32 tokens: TTFT and total latency).

Starts everything itself: fake upstream processes (aiohttp, a fixed completion), the gateway
(`python -m gateway.cli gateway --config <tmp yaml>`) and load-generator processes.

    .venv/bin/python benchmarks/gateway_bench.py [--duration-s 10] [--client-procs 2]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    import aiohttp

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "bench-model"
NUM_STREAM_TOKENS = 32


@dataclass(frozen=True, slots=True)
class PhaseResult:
    num_ok: int                      # 200 responses completed inside the measured window
    num_errors: int                  # non-200 or exceptions inside the measured window
    measured_s: float                # length of the measured window
    ttft_ms: tuple[float, ...]       # per request: first SSE data byte (streaming only)
    total_ms: tuple[float, ...]      # per request: whole response read


# --- the fake upstream ---------------------------------------------------------------------------

def _completion_body() -> bytes:
    return orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * NUM_STREAM_TOKENS},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": NUM_STREAM_TOKENS,
                  "total_tokens": 12 + NUM_STREAM_TOKENS}})


def _stream_events() -> list[bytes]:
    def chunk(delta: dict, finish: str | None, usage: dict | None = None) -> bytes:
        body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"
    events = [chunk({"role": "assistant", "content": "tok "}, None)]
    events += [chunk({"content": "tok "}, None) for _ in range(NUM_STREAM_TOKENS - 1)]
    events.append(chunk({}, "length", {"prompt_tokens": 12, "completion_tokens": NUM_STREAM_TOKENS,
                                       "total_tokens": 12 + NUM_STREAM_TOKENS}))
    events.append(b"data: [DONE]\n\n")
    return events


def run_upstream(port: int, token_interval_s: float) -> None:
    """Serve /health and /v1/chat/completions on `port` until killed."""
    import uvloop
    from aiohttp import web

    completion, events = _completion_body(), _stream_events()

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=completion, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            if token_interval_s:
                await asyncio.sleep(token_interval_s)
        await response.write_eof()
        return response

    async def serve() -> None:
        app = web.Application()
        app.add_routes([web.get("/health", health), web.post("/v1/chat/completions", chat)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()  # until SIGTERM ends the process

    uvloop.run(serve())


def run_relay(port: int, upstreams: list[str]) -> None:
    """The floor for any Python gateway: a bare aiohttp pass-through (no parsing, no policy)."""
    import aiohttp
    import uvloop
    from aiohttp import web

    async def serve() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        turn = 0

        async def relay(request: web.Request) -> web.StreamResponse:
            nonlocal turn
            turn += 1
            body = await request.read()
            async with session.post(upstreams[turn % len(upstreams)] + "/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as upstream:
                if upstream.content_type != "text/event-stream":
                    return web.Response(status=upstream.status, body=await upstream.read(),
                                        content_type=upstream.content_type)
                response = web.StreamResponse(status=upstream.status, headers={
                    "Content-Type": upstream.headers.get("Content-Type", "application/json")})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", relay)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()

    uvloop.run(serve())


# --- the load generators (run in worker processes) -----------------------------------------------

def _request_body(stream: bool) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": NUM_STREAM_TOKENS, "stream": stream,
                         "messages": [{"role": "user", "content": "Say something about switchyards."}]})


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> tuple[bool, float, float]:
    start = time.perf_counter()
    ttft = 0.0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        if stream:
            async for chunk in response.content.iter_any():
                if not ttft and b"data:" in chunk:
                    ttft = time.perf_counter() - start
        else:
            await response.read()
        ok = response.status == 200
    return ok, ttft * 1e3, (time.perf_counter() - start) * 1e3


def closed_loop(urls: list[str], concurrency: int, warmup_s: float, duration_s: float,
                stream: bool) -> PhaseResult:
    """`concurrency` clients each sending back to back; counts what completes in the window."""
    import aiohttp
    import uvloop

    async def main() -> PhaseResult:
        body = _request_body(stream)
        start = time.perf_counter()
        begin, end = start + warmup_s, start + warmup_s + duration_s
        ok, errors, ttfts, totals = 0, 0, [], []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def client(i: int) -> None:
                nonlocal ok, errors
                while time.perf_counter() < end:
                    try:
                        good, ttft, total = await _one(session, urls[i % len(urls)], body, stream)
                    except aiohttp.ClientError:
                        good, ttft, total = False, 0.0, 0.0
                    if begin <= time.perf_counter() < end:
                        ok += good
                        errors += not good
                        ttfts.append(ttft)
                        totals.append(total)
            await asyncio.gather(*(client(i) for i in range(concurrency)))
        return PhaseResult(ok, errors, duration_s, tuple(ttfts), tuple(totals))
    return uvloop.run(main())


def open_loop(urls: list[str], rate_per_s: float, warmup_s: float, duration_s: float, stream: bool,
              seed: int) -> PhaseResult:
    """Poisson arrivals at `rate_per_s` (seeded: the same schedule for direct and gateway)."""
    import aiohttp
    import uvloop

    async def main() -> PhaseResult:
        body, rng = _request_body(stream), random.Random(seed)
        results: list[tuple[bool, float, float]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def fire(i: int, measured: bool) -> None:
                try:
                    result = await _one(session, urls[i % len(urls)], body, stream)
                except aiohttp.ClientError:
                    result = (False, 0.0, 0.0)
                if measured:
                    results.append(result)
            start, at, i, tasks = time.perf_counter(), 0.0, 0, []
            while at < warmup_s + duration_s:
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(fire(i, at >= warmup_s)))
                i += 1
                at += rng.expovariate(rate_per_s)
            await asyncio.gather(*tasks)
        good = [r for r in results if r[0]]
        return PhaseResult(len(good), len(results) - len(good), duration_s,
                           tuple(r[1] for r in good), tuple(r[2] for r in good))
    return uvloop.run(main())


# --- orchestration -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not answer 200 within {timeout_s} s")
        time.sleep(0.1)


def gateway_config(port: int, upstreams: list[str], policy: str) -> str:
    return orjson.dumps({  # JSON is YAML
        "listen": {"host": "127.0.0.1", "port": port},
        "providers": {"fake": {"kind": "openai", "endpoints": upstreams, "health_path": "/health"}},
        "models": {MODEL: {"providers": ["fake"], "policy": {"name": policy}}},
        "ready": "each_model", "log_level": "WARNING",
    }).decode()


def percentile(values: tuple[float, ...], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_closed(pool: ProcessPoolExecutor, urls: list[str], args: argparse.Namespace,
               duration_s: float) -> PhaseResult:
    """Split the concurrency over the client processes and merge their results."""
    n = args.client_procs
    shares = [args.concurrency // n + (i < args.concurrency % n) for i in range(n)]
    futures = [pool.submit(closed_loop, urls[i % len(urls):] + urls[:i % len(urls)], share, args.warmup_s,
                           duration_s, False) for i, share in enumerate(shares)]
    merged = merge([f.result() for f in futures])
    return PhaseResult(merged.num_ok, merged.num_errors, duration_s, merged.ttft_ms, merged.total_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)  # internal: serve a fake upstream
    parser.add_argument("--relay", type=int, help=argparse.SUPPRESS)     # internal: serve the bare relay
    parser.add_argument("--relay-to", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--num-upstreams", type=int, default=2)
    parser.add_argument("--token-interval-ms", type=float, default=0.0, help="fake upstream delay per token")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--rates", type=float, nargs="+", default=[50.0, 200.0])
    parser.add_argument("--warmup-s", type=float, default=0.5, help="per round")
    parser.add_argument("--duration-s", type=float, default=12.0, help="measured, per phase and path")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per phase")
    parser.add_argument("--policy", default="least_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=pathlib.Path, metavar="PREFIX",
                        help="py-spy the gateway in each phase into PREFIX.<phase>.txt (raw stacks)")
    args = parser.parse_args()
    if args.upstream is not None:
        run_upstream(args.upstream, args.token_interval_ms / 1e3)
        return
    if args.relay is not None:
        run_relay(args.relay, args.relay_to)
        return

    processes: list[subprocess.Popen] = []
    try:
        upstreams = []
        for _ in range(args.num_upstreams):
            port = free_port()
            processes.append(subprocess.Popen([sys.executable, __file__, "--upstream", str(port),
                                               "--token-interval-ms", str(args.token_interval_ms)]))
            upstreams.append(f"http://127.0.0.1:{port}")
        for url in upstreams:
            wait_http(url + "/health", 20)
        relay_port = free_port()
        processes.append(subprocess.Popen([sys.executable, __file__, "--relay", str(relay_port),
                                           "--relay-to", *upstreams]))
        gateway_port = free_port()
        config = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        config.write(gateway_config(gateway_port, upstreams, args.policy))
        config.close()
        gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--config", config.name],
                                   cwd=ROOT)
        processes.append(gateway)
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        wait_http(gateway_url + "/ready", 30)
        upstream_pids = tuple(p.pid for p in processes[:args.num_upstreams])
        paths = [BenchPath("direct", tuple(u + "/v1/chat/completions" for u in upstreams), upstream_pids),
                 BenchPath("relay", (f"http://127.0.0.1:{relay_port}/v1/chat/completions",), (processes[args.num_upstreams].pid,)),
                 BenchPath("gateway", (gateway_url + "/v1/chat/completions",), (gateway.pid,))]
        run_phases(args, paths, Profiler(args.profile, gateway.pid,
                                              args.duration_s / args.rounds + args.warmup_s))
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


@dataclass(frozen=True, slots=True)
class BenchPath:
    label: str                       # direct, relay or gateway
    urls: tuple[str, ...]            # where the load generator sends
    pids: tuple[int, ...]            # the processes whose CPU time is charged to this path


def cpu_s(pids: tuple[int, ...]) -> float:
    """User + system CPU seconds used so far by `pids` (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class Profiler:
    """py-spy (installed beside this Python) recording the gateway for one phase, when asked."""

    def __init__(self, prefix: pathlib.Path | None, pid: int, duration_s: float) -> None:
        self._prefix, self._pid, self._duration_s = prefix, pid, duration_s
        self._process: subprocess.Popen | None = None

    def start(self, phase: str) -> None:
        if self._prefix is None:
            return
        py_spy = pathlib.Path(sys.executable).with_name("py-spy")
        self._process = subprocess.Popen(
            [str(py_spy), "record", "--pid", str(self._pid), "--format", "raw", "--rate", "250",
             "--duration", str(int(self._duration_s)), "--nonblocking",
             "--output", f"{self._prefix}.{phase}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self._process is not None:
            self._process.wait()
            self._process = None


def merge(parts: list[PhaseResult]) -> PhaseResult:
    return PhaseResult(sum(p.num_ok for p in parts), sum(p.num_errors for p in parts),
                       sum(p.measured_s for p in parts), sum((p.ttft_ms for p in parts), ()),
                       sum((p.total_ms for p in parts), ()))


def interleaved(paths: list[BenchPath], args: argparse.Namespace, profiler: Profiler, phase: str,
                run_one: Callable[[BenchPath, float], PhaseResult]) -> dict[str, tuple[PhaseResult, float]]:
    """Run a phase in `args.rounds` short rounds, alternating the paths' order, so that load drift
    on a shared machine falls on every path alike. Returns each path's merged result and its
    server CPU µs per completed request."""
    parts: dict[str, list[PhaseResult]] = {p.label: [] for p in paths}
    cpu_used_s = {p.label: 0.0 for p in paths}
    for k in range(args.rounds):
        for path in (paths if k % 2 == 0 else paths[::-1]):
            if path.label == "gateway" and k == 0:
                profiler.start(phase)
            before = cpu_s(path.pids)
            parts[path.label].append(run_one(path, args.duration_s / args.rounds))
            cpu_used_s[path.label] += cpu_s(path.pids) - before
            profiler.stop()
    results = {}
    for label, runs in parts.items():
        merged = merge(runs)
        results[label] = (merged, cpu_used_s[label] / max(1, merged.num_ok) * 1e6)
    return results


def run_phases(args: argparse.Namespace, paths: list[BenchPath], profiler: Profiler) -> None:
    print(f"fake upstreams: {args.num_upstreams} (token interval {args.token_interval_ms} ms); "
          f"gateway policy {args.policy}; {args.client_procs} client procs; cpus {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.1f}; {args.duration_s:.0f} s per phase and path in "
          f"{args.rounds} interleaved rounds, each after {args.warmup_s:.1f} s warm-up. CPU us/req: "
          f"the upstreams' for direct, the relay's or the gateway's own for the others", flush=True)
    with ProcessPoolExecutor(max_workers=args.client_procs) as pool:
        for path in paths:  # warm every path, its connection pools and the client processes
            pool.submit(closed_loop, list(path.urls), 4, 0.0, 0.5, True).result()
        print(f"\nclosed loop, concurrency {args.concurrency}, non-streaming")
        print(f"{'path':<10}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'CPU us/req':>12}{'errors':>8}")
        closed = interleaved(paths, args, profiler, "closed",
                             lambda path, d: run_closed(pool, list(path.urls), args, d))
        for label, (r, cpu_us) in closed.items():
            print(f"{label:<10}{r.num_ok / r.measured_s:>10.0f}{percentile(r.total_ms, 0.5):>9.2f}"
                  f"{percentile(r.total_ms, 0.99):>9.2f}{cpu_us:>12.0f}{r.num_errors:>8}", flush=True)
        for rate in args.rates:
            print(f"\nopen loop, Poisson {rate:.0f} req/s, streaming {NUM_STREAM_TOKENS} tokens (ms)")
            print(f"{'path':<10}{'TTFT p50':>10}{'TTFT p99':>10}{'total p50':>11}{'total p99':>11}"
                  f"{'CPU us/req':>12}{'ok':>7}{'errors':>8}")
            opened = interleaved(paths, args, profiler, f"open{rate:.0f}", lambda path, d: pool.submit(
                open_loop, list(path.urls), rate, args.warmup_s, d, True, args.seed).result())
            rows = {}
            for label, (r, cpu_us) in opened.items():
                rows[label] = (percentile(r.ttft_ms, 0.5), percentile(r.ttft_ms, 0.99),
                               percentile(r.total_ms, 0.5), percentile(r.total_ms, 0.99))
                print(f"{label:<10}" + _cells(rows[label]) + f"{cpu_us:>12.0f}{r.num_ok:>7}{r.num_errors:>8}")
            for label in ("relay", "gateway"):
                print(f"{'+' + label:<10}" + _cells(tuple(v - d for v, d in zip(rows[label], rows["direct"]))),
                      flush=True)


def _cells(values: tuple[float, ...]) -> str:
    return "".join(f"{v:>10.2f}" if i < 2 else f"{v:>11.2f}" for i, v in enumerate(values))


if __name__ == "__main__":
    main()
