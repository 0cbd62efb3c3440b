"""What a worker's first structured request (JSON mode, a schema, a forced tool call) costs the streams already
running: on a fresh worker, one greedy stream decodes; after WARM chunks a second request arrives, and the
longest gap between the stream's chunks from then on is measured. The baseline, in the same run, is a plain
request arriving on another fresh worker at the same point (its prefill interrupts the stream too); the first
structured request also builds the tokenizer's byte tries and the grammar's first masks. Median over rounds.

    .venv/bin/python benchmarks/structured_first_request.py [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.worker_proc import WorkerProcess  # noqa: E402

WARM = 24                # the stream's chunks before the second request arrives
STREAM_TOKENS = 120
ASK = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]


async def longest_gap_after_arrival(url: str, second: dict) -> float:
    """The longest gap (ms) between the stream's chunks from the second request's arrival to its answer."""
    body = {"messages": [{"role": "user", "content": "Tell me a long story about the sea."}], "stream": True,
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0}
    stamps: list[float] = []
    arrived = asyncio.Event()
    answered_at: list[float] = []

    async def send_second(session: aiohttp.ClientSession) -> None:
        await arrived.wait()
        async with session.post(url + "/v1/chat/completions", json=second) as response:
            assert response.status == 200, await response.text()
            await response.read()
        answered_at.append(time.perf_counter())

    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(send_second(session))
        arrival = 0.0
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.perf_counter())
                    if len(stamps) == WARM:
                        arrival = stamps[-1]
                        arrived.set()
        await task
    window = [s for s in stamps if s >= arrival and s <= answered_at[0] + 0.5]
    return max(b - a for a, b in itertools.pairwise(window)) * 1e3


def one_round(threads: int) -> dict[str, float]:
    plain = {"messages": ASK, "max_tokens": 16, "temperature": 0}
    structured = {**plain, "response_format": {"type": "json_object"}}
    out = {}
    for name, second in (("plain", plain), ("first json_object", structured)):
        worker = WorkerProcess(["--threads", str(threads), "--num-blocks", "256"])
        try:
            out[name] = asyncio.run(longest_gap_after_arrival(worker.url, second))
        finally:
            worker.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} cores | fresh worker per measurement, --threads {args.threads}")
    rounds = [one_round(args.threads) for _ in range(args.rounds)]
    print("| second request | longest gap in the running stream, ms (each round) | median |")
    print("|---|---|---|")
    for name in rounds[0]:
        gaps = [r[name] for r in rounds]
        print(f"| {name} | {' '.join(f'{g:.0f}' for g in gaps)} | {statistics.median(gaps):.0f} |")
    ratio = statistics.median(r["first json_object"] / r["plain"] for r in rounds)
    print(f"first json_object / plain (baseline), median of per-round ratios: {ratio:.2f}x")


if __name__ == "__main__":
    main()
