"""Serve SmolLM2 with a switchyard worker and measure it beside transformers' `generate`, in one run.

Reports single-stream TTFT and inter-token latency (p50/p90) and aggregate output tokens/s at
several concurrencies, with and without a shared ~200-token system prompt. A script, not a test:

    .venv/bin/python benchmarks/worker_bench.py [--new-tokens 64] [--concurrency 1 8 32]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.worker.loader import resolve_model  # noqa: E402

TOPICS = ["the ocean", "volcanoes", "a lighthouse keeper", "bread baking", "the moon", "chess",
          "honeybees", "trains", "rainforests", "glaciers", "jazz", "a old library", "robots",
          "kites", "deserts", "owls"]
SYSTEM = ("You are a meticulous assistant for a travel company. Answer in plain English, keep a "
          "friendly tone, never invent prices, cite the policy section when you quote a rule, and "
          "prefer short paragraphs. Policies: refunds within 14 days of booking; changes free up to "
          "48 hours before departure; pets allowed on trains but not on buses; luggage limit 23 kg; "
          "children under 4 travel free; seniors get 10 percent off weekday fares; group bookings of "
          "ten or more get a dedicated agent; lost items are kept for 30 days; accessibility help must "
          "be booked 24 hours ahead; loyalty points expire after two years; all times are local. "
          "Night trains have sleeper cabins for two or four people; bicycles need a reservation in summer; "
          "station lounges are open to first-class ticket holders; delays over an hour earn a 25 percent "
          "refund and over two hours 50 percent; tickets bought on board cost five euros more; students "
          "with a valid card get 15 percent off; and customer service answers within two working days.")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- transformers baseline
def hf_baseline(model_dir: Path, prompts: list[str], new_tokens: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):  # called once per generated token
            self.stamps.append(time.perf_counter())
            return scores

    ttfts, itls, total_tokens, total_s = [], [], 0, 0.0
    for text in prompts:
        ids = tok(text, return_tensors="pt")
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, logits_processor=[clock], pad_token_id=tok.eos_token_id)
        t1 = time.perf_counter()
        ttfts.append(clock.stamps[0] - t0)
        itls.extend(b - a for a, b in zip(clock.stamps, clock.stamps[1:]))
        total_tokens += out.shape[1] - ids["input_ids"].shape[1]
        total_s += t1 - t0
    return {"ttft_p50_ms": 1e3 * pct(ttfts, 50), "itl_p50_ms": 1e3 * pct(itls, 50),
            "itl_p90_ms": 1e3 * pct(itls, 90), "tok_s": total_tokens / total_s}


# ---------------------------------------------------------------- switchyard worker
async def stream_one(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, list[float], int]:
    """One streaming request: (ttft_s, inter-token gaps, number of chunks with text)."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[5:])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps, len(stamps)


def chat_body(topic: str, new_tokens: int, shared_prefix: bool) -> dict:
    messages = [{"role": "user", "content": f"Write a long story about {topic}."}]
    if shared_prefix:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return {"model": "smollm2", "messages": messages, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def run_level(base: str, concurrency: int, rounds: int, new_tokens: int, shared: bool) -> dict:
    url = base + "/v1/chat/completions"
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        # One warm-up request that also seeds the prefix cache for the shared-prefix runs.
        await stream_one(session, url, chat_body("warm-up", 4, shared))
        t0 = time.perf_counter()

        async def client(i: int) -> None:
            nonlocal tokens
            for r in range(rounds):
                topic = TOPICS[(i + r * concurrency) % len(TOPICS)] + f" #{i}-{r}"
                ttft, g, n = await stream_one(session, url, chat_body(topic, new_tokens, shared))
                ttfts.append(ttft)
                gaps.extend(g)
                tokens += n

        await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"ttft_p50_ms": 1e3 * pct(ttfts, 50), "ttft_p90_ms": 1e3 * pct(ttfts, 90),
            "itl_p50_ms": 1e3 * pct(gaps, 50), "itl_p90_ms": 1e3 * pct(gaps, 90), "tok_s": tokens / wall}


def start_worker(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "backends.server", "--model", "smollm2", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    import urllib.request
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"worker exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("worker did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--hf-prompts", type=int, default=3)
    ap.add_argument("--worker-args", default="", help="extra worker flags, e.g. '--dtype bfloat16'")
    args = ap.parse_args()

    model_dir = resolve_model("smollm2")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.node()} | {platform.processor() or platform.machine()} "
          f"| {os.cpu_count()} cores | torch {torch.__version__} | fp32 | new_tokens={args.new_tokens}")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    print(f"# shared system prompt: {len(tok(SYSTEM)['input_ids'])} tokens")

    hf_prompts = [tok.apply_chat_template(chat_body(t, 0, False)["messages"], tokenize=False,
                                          add_generation_prompt=True) for t in TOPICS[: args.hf_prompts]]
    hf = hf_baseline(model_dir, hf_prompts, args.new_tokens)

    rows = []
    # The shared-prefix rows run twice: with the prefix cache, and on a worker without it (the baseline
    # that shows what the cache saves on the very same prompts).
    for label, flags, levels in (("switchyard worker", [], [(s, c) for s in (False, True) for c in args.concurrency]),
                                 ("switchyard, prefix cache off", ["--no-prefix-caching"],
                                  [(True, c) for c in args.concurrency if c <= 8])):
        port = free_port()
        proc = start_worker(port, args.worker_args.split() + flags)
        try:
            base = f"http://127.0.0.1:{port}"
            for shared, c in levels:
                rounds = 3 if c == 1 else 1
                rows.append((label, c, shared, asyncio.run(run_level(base, c, rounds, args.new_tokens, shared))))
        finally:
            proc.terminate()
            proc.wait(30)

    print("\n| engine | concurrency | shared 200-tok prefix | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | output tok/s | × HF batch-1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| transformers generate (baseline) | 1 | no | {hf['ttft_p50_ms']:.1f} | – | {hf['itl_p50_ms']:.1f} "
          f"| {hf['itl_p90_ms']:.1f} | {hf['tok_s']:.1f} | 1.00 |")
    for label, c, shared, r in rows:
        print(f"| {label} | {c} | {'yes' if shared else 'no'} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} "
              f"| {r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | {r['tok_s']:.1f} | {r['tok_s'] / hf['tok_s']:.2f} |")


if __name__ == "__main__":
    main()
