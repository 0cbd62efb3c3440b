"""How right is a gateway process's in-flight estimate when several processes route to the same endpoints?

Two fake workers stream 32 tokens each (a delay per token) and keep their own exact counts: requests
running and output tokens still to produce (max_tokens minus produced). They serve those counts as the
worker `/load` report and at `/truth`. A gateway with `--workers N` (Redis store, least_tokens) takes Poisson
streaming load; a sampler scrapes /metrics on fresh connections (each time whichever process the kernel
picks) and, at the same moment, every worker's `/truth`, and compares the process's estimate per endpoint
with the worker's own count. Modes, each in the same run:

- local: each process's own leases only (no sharing, no reports): what N processes see without this work;
- reports: own leases + the workers' /load reports (polled every 0.25 s);
- shared: own leases + the peers' leases through Redis (published every 0.25 s);
- shared+reports: both;
- shared@0.1s: the peers' leases published every 0.1 s (staleness against Redis traffic).

    .venv/bin/python benchmarks/inflight_estimate.py [--gateway-workers 2] [--rate 40] [--duration-s 12]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_bench import ROOT
from gateway_bench_load import free_port, wait_http

NUM_TOKENS = 32
MODES = {"local": (0.0, False), "reports": (0.0, True), "shared": (0.25, False), "shared+reports": (0.25, True),
         "shared@0.1s": (0.1, False)}


def run_worker(port: int, token_interval_s: float) -> None:
    """A fake engine that knows its own load exactly."""
    import uvloop
    from aiohttp import web

    running = {"requests": 0, "decode": 0}

    def chunk(delta: dict, finish: str | None) -> bytes:
        return b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        num_tokens = min(NUM_TOKENS, int(body.get("max_tokens") or NUM_TOKENS))
        running["requests"] += 1
        running["decode"] += num_tokens
        left = num_tokens
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(num_tokens):
                await asyncio.sleep(token_interval_s)
                await response.write(chunk({"content": "tok "}, None))
                left -= 1
                running["decode"] -= 1
            await response.write(chunk({}, "length") + b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            running["requests"] -= 1
            running["decode"] -= left

    async def load(request: web.Request) -> web.Response:
        return web.json_response({
            "num_running": running["requests"], "num_waiting": 0, "num_prefill_tokens_pending": 0,
            "num_decode_tokens_pending": running["decode"], "num_free_blocks": 100, "num_total_blocks": 100,
            "num_cached_blocks": 0, "block_size": 16})

    async def truth(request: web.Request) -> web.Response:
        return web.json_response(running)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def serve() -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", chat), web.get("/load", load), web.get("/truth", truth),
                        web.get("/health", health)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()

    uvloop.run(serve())


def gateway_config(port: int, workers: list[str], redis_url: str, share_interval_s: float, reports: bool) -> str:
    return orjson.dumps({
        "listen": {"host": "127.0.0.1", "port": port}, "redis_url": redis_url, "log_level": "WARNING",
        "providers": {"w": {"kind": "openai", "endpoints": workers, "health_path": "/health", "offers_load": reports}},
        "models": {"m": {"providers": ["w"], "policy": {"name": "least_tokens"}}},
        "pollers": {"share_interval_s": share_interval_s, "load_interval_s": 0.25},
    }).decode()


async def drive_and_sample(url: str, workers: list[str], rate: float, duration_s: float,
                           sample_interval_s: float) -> list[tuple[str, int, int, float, float]]:
    """Poisson streaming load for `duration_s`; returns samples (worker, true requests, true decode tokens,
    estimated requests, estimated decode tokens)."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    body = orjson.dumps({"model": "m", "max_tokens": NUM_TOKENS, "stream": True,
                         "messages": [{"role": "user", "content": "hello"}]})
    samples: list[tuple[str, int, int, float, float]] = []
    rng = random.Random(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as load_client, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as probe:
        async def one() -> None:
            async with load_client.post(url + "/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as response:
                await response.read()

        async def sample() -> None:
            metrics, *truths = await asyncio.gather(
                probe.get(url + "/metrics"), *(probe.get(w + "/truth") for w in workers))
            text = await metrics.text()
            true = [await t.json() for t in truths]
            estimate: dict[tuple[str, str], float] = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "switchyard_inflight_requests":
                        estimate[(s.labels["endpoint"], "requests")] = s.value
                    elif s.name == "switchyard_inflight_tokens" and s.labels["phase"] == "decode":
                        estimate[(s.labels["endpoint"], "decode")] = s.value
            for worker, counts in zip(workers, true, strict=True):
                samples.append((worker, counts["requests"], counts["decode"],
                                estimate.get((worker, "requests"), 0.0), estimate.get((worker, "decode"), 0.0)))

        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        next_arrival, next_sample = 0.0, 2.0  # the first 2 s warm up (estimator, pollers)
        while (now := time.perf_counter() - start) < duration_s:
            if now >= next_arrival:
                tasks.append(asyncio.create_task(one()))
                next_arrival += rng.expovariate(rate)
            if now >= next_sample:
                await sample()
                next_sample += sample_interval_s
            await asyncio.sleep(min(0.002, max(0.0, min(next_arrival, next_sample) - now)))
        await asyncio.gather(*tasks, return_exceptions=True)
    return samples


def summarize(samples: list[tuple[str, int, int, float, float]]) -> tuple[float, float, float, float]:
    """(mean |error| in requests, the same relative to the mean true count, the same two for decode tokens)."""
    n = max(1, len(samples))
    err_requests = sum(abs(s[3] - s[1]) for s in samples) / n
    err_decode = sum(abs(s[4] - s[2]) for s in samples) / n
    mean_requests = sum(s[1] for s in samples) / n or 1.0
    mean_decode = sum(s[2] for s in samples) / n or 1.0
    return err_requests, err_requests / mean_requests, err_decode, err_decode / mean_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # internal: serve a fake worker
    parser.add_argument("--token-interval-ms", type=float, default=20.0)
    parser.add_argument("--gateway-workers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=40.0, help="requests/s (each lasts ~32 token intervals)")
    parser.add_argument("--duration-s", type=float, default=12.0, help="per mode (the first 2 s are warm-up)")
    parser.add_argument("--sample-interval-s", type=float, default=0.05)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    if args.worker is not None:
        run_worker(args.worker, args.token_interval_ms / 1e3)
        return
    processes: list[subprocess.Popen] = []
    try:
        redis_port = free_port()
        processes.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                           "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL))
        workers = []
        for _ in range(2):
            port = free_port()
            processes.append(subprocess.Popen([sys.executable, __file__, "--worker", str(port),
                                               "--token-interval-ms", str(args.token_interval_ms)]))
            workers.append(f"http://127.0.0.1:{port}")
        for worker in workers:
            wait_http(worker + "/health", 20)
        print(f"{args.gateway_workers} gateway processes, 2 fake workers ({NUM_TOKENS} tokens, "
              f"{args.token_interval_ms} ms apart), Poisson {args.rate:.0f} req/s, {args.duration_s:.0f} s per mode; "
              f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
        print(f"{'mode':<16}{'samples':>8}{'true req':>9}{'|err| req':>10}{'rel':>7}{'true dec':>9}"
              f"{'|err| dec':>10}{'rel':>7}")
        for mode in args.modes:
            share_interval_s, reports = MODES[mode]
            port = free_port()
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as config:
                config.write(gateway_config(port, workers, f"redis://127.0.0.1:{redis_port}/0",
                                            share_interval_s, reports))
            gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--config", config.name,
                                        "--workers", str(args.gateway_workers)], cwd=ROOT)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_http(url + "/ready", 60)
                time.sleep(1.0)  # every process up (the parent's /ready answers once any one is)
                samples = asyncio.run(drive_and_sample(url, workers, args.rate, args.duration_s,
                                                       args.sample_interval_s))
            finally:
                gateway.send_signal(signal.SIGTERM)
                gateway.wait(60)
                os.unlink(config.name)
            n = max(1, len(samples))
            err_req, rel_req, err_dec, rel_dec = summarize(samples)
            print(f"{mode:<16}{len(samples):>8}{sum(s[1] for s in samples) / n:>9.2f}{err_req:>10.2f}"
                  f"{rel_req:>7.0%}{sum(s[2] for s in samples) / n:>9.1f}{err_dec:>10.1f}{rel_dec:>7.0%}", flush=True)
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(10)


if __name__ == "__main__":
    main()
