"""gpu_bench's disagg section: decode streams' inter-token latency while long prompts arrive, served by
one `both` worker process (unified) and by a prefill and a decode worker process (disaggregated), all on
the same GPU. The client drives the legs itself (prefill with do_remote_decode, then the decode leg with
the returned kv_transfer_params): what is measured is the workers, not a gateway."""
from __future__ import annotations

import asyncio
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
MAX_LONG_IN_FLIGHT = 4
LONG_OUTPUT_TOKENS = 8


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(role: str, port: int, work: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "backends.server", "--role", role, "--port", str(port), "--device", "cuda",
           "--dtype", "bfloat16", "--num-blocks", "20000", "--max-num-batched-tokens", "2048",
           "--served-model-name", MODEL]
    log = (work / f"{role}-{port}.log").open("wb")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


async def wait_healthy(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {url} exited with {proc.returncode}")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"worker {url} not healthy in 300 s")


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url + "/v1/completions", json=body) as r:
        payload = orjson.loads(await r.read())
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {payload}")
        return payload


async def stream_gaps(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[float]:
    """Seconds between the stream's successive token events (the first event excluded)."""
    gaps, last = [], None
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


class Mode:
    def __init__(self, name: str, prefill_url: str, decode_url: str) -> None:
        self.name, self.prefill_url, self.decode_url = name, prefill_url, decode_url

    @property
    def split(self) -> bool:
        return self.prefill_url != self.decode_url

    async def kv_body(self, session: aiohttp.ClientSession, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """The body the decode URL gets: after a prefill leg when split, else the whole request."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        if not self.split:
            return body
        pre = await post(session, self.prefill_url, {**body, "max_tokens": 1,
                                                     "kv_transfer_params": {"do_remote_decode": True}})
        return {**body, "kv_transfer_params": {**pre["kv_transfer_params"], "response_id": pre["id"]}}


async def run_mode(mode: Mode, streams: int, stream_tokens: int, long_tokens: int, long_every_s: float,
                   seed: int) -> tuple[list[float], int]:
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(1000, 30000) for _ in range(n)]   # noqa: E731
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one_stream() -> list[float]:
            return await stream_gaps(session, mode.decode_url, await mode.kv_body(session, prompt(64), stream_tokens))

        async def one_long() -> None:
            await post(session, mode.decode_url, await mode.kv_body(session, prompt(long_tokens), LONG_OUTPUT_TOKENS))

        tasks = [asyncio.create_task(one_stream()) for _ in range(streams)]
        in_flight: set[asyncio.Task] = set()
        sent = 0
        while not all(t.done() for t in tasks):
            in_flight = {t for t in in_flight if not t.done()}
            if len(in_flight) < MAX_LONG_IN_FLIGHT:
                in_flight.add(asyncio.create_task(one_long()))
                sent += 1
            await asyncio.sleep(long_every_s)
        await asyncio.gather(*in_flight)
        gaps = [g for t in tasks for g in t.result()]
    return gaps, sent


def print_worker_errors(work: Path) -> None:
    """The workers' side of a failure: each log's first traceback or error line and what follows."""
    for log in sorted(work.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        errors = [i for i, line in enumerate(lines) if "Traceback" in line or " ERROR " in line]
        if errors:
            print(f"--- {log.name}:", *lines[errors[0]:errors[0] + 40], sep="\n")


async def run_disagg(work: Path, streams: int, stream_tokens: int, long_tokens: int, long_every_s: float) -> None:
    ports = {role: free_port() for role in ("both", "prefill", "decode")}
    procs = {role: start_worker(role, port, work) for role, port in ports.items()}
    url = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    try:
        async with aiohttp.ClientSession() as session:
            for role, proc in procs.items():
                await wait_healthy(session, url[role], proc)
        modes = [Mode("unified", url["both"], url["both"]), Mode("disaggregated", url["prefill"], url["decode"])]
        for mode in modes:   # warm-up: first requests compile and allocate
            await run_mode(mode, 2, 16, 512, 0.5, seed=99)
        rows = []
        for round_ in range(2):
            for mode in modes:
                gaps, sent = await run_mode(mode, streams, stream_tokens, long_tokens, long_every_s, seed=round_)
                rows.append((mode.name, round_, gaps, sent))
    except Exception:
        print_worker_errors(work)
        raise
    finally:
        for proc in procs.values():
            proc.kill()   # held KV would keep a draining worker alive for its hold timeout
        for proc in procs.values():
            proc.wait(30)
    print(f"\n## disaggregated vs unified on one GPU: {streams} streams x {stream_tokens} tokens, long prompts of "
          f"{long_tokens} tokens every {long_every_s} s (at most {MAX_LONG_IN_FLIGHT} at once)")
    print("| mode | round | ITL p50 ms | ITL p90 ms | long prompts |\n|---|---|---|---|---|")
    for name, round_, gaps, sent in rows:
        print(f"| {name} | {round_} | {pct(gaps, 50) * 1e3:.2f} | {pct(gaps, 90) * 1e3:.2f} | {sent} |")
    p90 = {name: statistics.median(pct(g, 90) for n, _, g, _ in rows if n == name) for name, *_ in rows}
    print(f"ITL p90, unified / disaggregated (median of rounds): {p90['unified'] / p90['disaggregated']:.2f}x")
