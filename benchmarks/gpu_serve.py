"""The bundled SmolLM2-135M served over HTTP against the same engine driven in this process, in one run (not a
test). Modes: inprocess (LLMEngine here, configured as the worker CLI configures it), worker (one worker
process, the client talks to it), gateway (that worker behind a gateway process), pd (a prefill and a decode
worker behind the gateway, switchyard-pd). Per concurrency c: c streams started together, each a prompt of
random token ids (/v1/completions, seeded, the same in every mode), greedy, ignore_eos, through the OpenAI SDK;
TTFT, inter-token latency (pooled over streams) and output tokens/s of the batch.

    python benchmarks/gpu_serve.py [--modes inprocess,worker,gateway,pd] [--concurrency 1,8,64] [--json PATH]
    python benchmarks/gpu_serve.py --device cpu --concurrency 1,2 --output-tokens 8 --prompt-tokens 16  # dry run
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
import multiprocessing
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_disagg import MODEL, free_port, pct, wait_healthy  # noqa: E402
from gateway.ops.supervisor import ServePlan, gateway_config  # noqa: E402

if TYPE_CHECKING:   # torch and the worker are imported where they run: the client processes import neither
    from backends.engine.engine import LLMEngine

MODES = ("inprocess", "worker", "gateway", "pd")
WARMUP_TOKENS = 4
LOG_TAIL_LINES = 40
START_MARGIN_S = 0.2   # a batch's client processes start their streams this long after it is dealt
STREAM_TIMEOUT_S = 60   # a stream that stalls this long fails the run
BUSY = 0.8             # a client process busier than this (CPU / wall) is noted: its ITL is partly its own


@dataclass(slots=True)
class Batch:
    """One batch of c streams: every stream's TTFT, the pooled gaps between token events, the tokens out."""
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    multi_token_events: int = 0   # events (engine steps, SSE chunks) that carried more than one token
    client_busy: float = 0.0      # CPU time / wall time of the busiest client process (in-process: the engine's)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--num-blocks", type=int, default=None, help="each worker's KV blocks (default: what the "
                   "largest batch needs, twice over, + 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="every engine's (the worker's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=None, help="a model folder (default: the bundled SmolLM2, "
                   "converted); a small random one makes a CPU step short enough to show the host's share")
    p.add_argument("--client-procs", type=int, default=4, help="client processes a batch's streams are dealt "
                   "round (the SDK parses a chunk in tens of µs: one process would lag at c=64 on a GPU)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here as JSON (after each row)")
    args = p.parse_args()
    args.modes = args.modes.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.num_blocks = args.num_blocks or max(args.concurrency) * -(-(args.prompt_tokens + args.output_tokens)
                                                                    // 16) * 2 + 64
    return args


def prompts(args: argparse.Namespace, c: int, warmup: bool) -> list[list[int]]:
    """c prompts of random token ids (no special tokens), the same in every mode; warm-up ones differ (no
    prefix-cache hits on the timed ones)."""
    rng = random.Random(f"{args.seed}-{c}-{warmup}")
    return [[rng.randrange(1000, 30000) for _ in range(args.prompt_tokens)] for _ in range(c)]


def worker_flags(args: argparse.Namespace, role: str, port: int) -> list[str]:
    """The worker CLI's flags; the in-process engine is configured from the same ones."""
    return ["--model", str(args.model_dir), "--port", str(port), "--role", role, "--device", args.device,
            "--dtype", args.dtype,
            "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(max(64, *args.concurrency)),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--served-model-name", MODEL,
            "--log-level", "WARNING"]


# --- in-process ---------------------------------------------------------------------------------------

def drive_engine(engine: LLMEngine, batch_prompts: list[list[int]], max_tokens: int) -> Batch:
    """As gpu_bench.run_requests, per request: TTFT from its add_request, gaps between its token steps."""
    from backends.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = Batch()
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    cpu, start = time.process_time(), time.perf_counter()
    for i, prompt in enumerate(batch_prompts):
        rid = f"r{start}-{i}"
        added[rid] = time.perf_counter()
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            if not o.new_token_ids:
                continue
            out.tokens += len(o.new_token_ids)
            out.multi_token_events += len(o.new_token_ids) > 1
            if o.request_id in last:
                out.itl_s.append(now - last[o.request_id])
            else:
                out.ttft_s.append(now - added[o.request_id])
            last[o.request_id] = now
    out.wall_s = time.perf_counter() - start
    out.client_busy = (time.process_time() - cpu) / out.wall_s
    return out


def run_inprocess(args: argparse.Namespace, report: Report) -> None:
    import torch

    from backends.engine.engine import LLMEngine
    from backends.server.__main__ import build_configs, build_parser

    _, config = build_configs(build_parser().parse_args(worker_flags(args, "both", 1)))
    engine = LLMEngine(config)
    gc.freeze()   # as the worker does once its engine is up: no collection walks the model's objects
    try:
        for c in args.concurrency:
            drive_engine(engine, prompts(args, c, warmup=True), WARMUP_TOKENS)
            report.add("inprocess", c, drive_engine(engine, prompts(args, c, warmup=False), args.output_tokens))
    finally:
        engine.close()
        del engine
        gc.unfreeze()
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


# --- served -------------------------------------------------------------------------------------------

async def one_stream(client: Any, prompt: list[int], max_tokens: int, out: Batch) -> None:
    """One streamed completion: its TTFT and gaps into `out`; exactly `max_tokens` tokens, checked."""
    tokens, usage, last = 0, None, None
    sent = time.perf_counter()
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        ids = (chunk.choices[0].model_extra or {}).get("token_ids")
        if ids is None:
            raise RuntimeError(f"a chunk without token_ids: {chunk}")
        if not ids:
            continue
        now = time.perf_counter()
        tokens += len(ids)
        out.multi_token_events += len(ids) > 1
        if last is None:
            out.ttft_s.append(now - sent)
        else:
            out.itl_s.append(now - last)
        last = now
    if tokens != max_tokens or usage is None or usage.completion_tokens != max_tokens \
            or usage.prompt_tokens != len(prompt):
        raise RuntimeError(f"asked {max_tokens} tokens of a {len(prompt)}-token prompt, got {tokens} in chunks, "
                           f"usage {usage}")
    out.tokens += tokens


async def drive_served(client: Any, batch_prompts: list[list[int]], max_tokens: int) -> Batch:
    out = Batch()
    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one_stream(client, p, max_tokens, out) for p in batch_prompts))
    out.wall_s = time.perf_counter() - start
    out.client_busy = (time.process_time() - cpu) / out.wall_s
    return out


_LOOP: list[asyncio.AbstractEventLoop] = []   # a client process's own event loop, kept across its batches
_CLIENTS: dict[str, Any] = {}                 # and its client per base URL (its connections stay open)


def client_share(url: str, share: list[list[int]], max_tokens: int, start_at: float) -> Batch:
    """In a client process: its share of a batch's streams, started at `start_at` (time.monotonic)."""
    from openai import AsyncOpenAI, OpenAIError

    if not _LOOP:
        _LOOP.append(asyncio.new_event_loop())
        atexit.register(close_clients)
    if url not in _CLIENTS:
        _CLIENTS[url] = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=STREAM_TIMEOUT_S)
    time.sleep(max(0.0, start_at - time.monotonic()))
    try:
        return _LOOP[0].run_until_complete(drive_served(_CLIENTS[url], share, max_tokens))
    except OpenAIError as exc:   # the SDK's errors do not unpickle: the parent gets their text
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


def close_clients() -> None:
    """At a client process's exit: its connections closed, its loop's async generators finalised."""
    for client in _CLIENTS.values():
        _LOOP[0].run_until_complete(client.close())
    _LOOP[0].run_until_complete(_LOOP[0].shutdown_asyncgens())
    _LOOP[0].close()


def run_batch(pool: ProcessPoolExecutor, procs: int, url: str, batch_prompts: list[list[int]],
              max_tokens: int) -> Batch:
    """The streams dealt round `procs` client processes, all started at one moment; their results merged."""
    k = min(len(batch_prompts), procs)
    start_at = time.monotonic() + START_MARGIN_S
    futures = [pool.submit(client_share, url, batch_prompts[i::k], max_tokens, start_at) for i in range(k)]
    shares = [f.result() for f in futures]
    return Batch([t for s in shares for t in s.ttft_s], [g for s in shares for g in s.itl_s],
                 sum(s.tokens for s in shares), max(s.wall_s for s in shares),
                 sum(s.multi_token_events for s in shares), max(s.client_busy for s in shares))


class Processes:
    """A mode's worker and gateway processes; logs in one folder; stopped politely, then killed."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name]

    def check(self) -> None:
        if dead := {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}:
            raise RuntimeError(f"processes exited: {dead}")

    def print_tails(self) -> None:
        for name in self.procs:
            lines = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
            print(f"--- {name} (exit {self.procs[name].poll()}), last {LOG_TAIL_LINES} lines of its log:",
                  *lines[-LOG_TAIL_LINES:], sep="\n", file=sys.stderr, flush=True)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen) -> None:
    """The gateway: healthy, then ready (each model has a healthy endpoint)."""
    await wait_healthy(session, url, proc)
    for _ in range(300):
        async with session.get(url + "/ready") as r:
            if r.status == 200:
                return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"gateway {url} not ready in 30 s")


async def start_mode(mode: str, args: argparse.Namespace, procs: Processes) -> str:
    """Start a served mode's processes; the base URL the client talks to, once it answers."""
    roles = ("prefill", "decode") if mode == "pd" else ("both",)
    ports = {role: free_port() for role in roles}
    for role, port in ports.items():
        procs.start(f"{mode}-{role}", ["-m", "backends.server", *worker_flags(args, role, port)])
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    async with aiohttp.ClientSession() as session:
        for role in roles:   # one after the other: each loads the model and captures its graphs
            await wait_healthy(session, urls[role], procs.procs[f"{mode}-{role}"])
        if mode == "worker":
            return urls["both"]
        pools = {"prefill": [urls["prefill"]], "decode": [urls["decode"]], "both": []} if mode == "pd" \
            else {"prefill": [], "decode": [], "both": [urls["both"]]}
        port = free_port()
        config = gateway_config(ServePlan(port=port, served_model_name=MODEL, gateway={"log_level": "WARNING"}),
                                args.model_dir, pools)
        path = procs.logs / f"{mode}-gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = procs.start(f"{mode}-gateway", ["-m", "gateway.cli", "gateway", "--config", str(path)])
        await wait_ready(session, f"http://127.0.0.1:{port}", gateway)
        return f"http://127.0.0.1:{port}"


def run_served(mode: str, args: argparse.Namespace, report: Report, logs: Path, pool: ProcessPoolExecutor) -> None:
    procs = Processes(logs)
    try:
        url = asyncio.run(start_mode(mode, args, procs))
        for c in args.concurrency:
            run_batch(pool, args.client_procs, url, prompts(args, c, warmup=True), WARMUP_TOKENS)
            report.add(mode, c, run_batch(pool, args.client_procs, url, prompts(args, c, warmup=False),
                                          args.output_tokens))
            procs.check()
    except BaseException:
        procs.print_tails()
        raise
    finally:
        procs.stop()


# --- report -------------------------------------------------------------------------------------------

class Report:
    def __init__(self, args: argparse.Namespace) -> None:
        self.json_path = args.json
        self.rows: list[dict[str, Any]] = []
        import torch

        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU (dry run)"
        print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {device}, torch {torch.__version__}, {args.dtype}: "
              f"{shlex.join([sys.executable, *sys.argv])}")
        print(f"prompt {args.prompt_tokens} random token ids, {args.output_tokens} output tokens a stream "
              f"(ignore_eos, greedy); {args.num_blocks} KV blocks an engine; served: streamed through the OpenAI SDK "
              f"from {args.client_procs} client processes; ITL pooled over the streams")
        print("| mode | c | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | tok/s | ITL p50 / in-process |\n"
              "|---|---|---|---|---|---|---|---|", flush=True)

    def add(self, mode: str, c: int, batch: Batch) -> None:
        row = {"mode": mode, "c": c, "ttft_p50_ms": pct(batch.ttft_s, 50) * 1e3,
               "ttft_p90_ms": pct(batch.ttft_s, 90) * 1e3, "itl_p50_ms": pct(batch.itl_s, 50) * 1e3,
               "itl_p90_ms": pct(batch.itl_s, 90) * 1e3, "tok_s": batch.tokens / batch.wall_s,
               **{k: v for k, v in asdict(batch).items() if k not in ("ttft_s", "itl_s")}}
        self.rows.append(row)
        base = next((r for r in self.rows if r["mode"] == "inprocess" and r["c"] == c), None)
        row["itl_p50_vs_inprocess"] = row["itl_p50_ms"] / base["itl_p50_ms"] if base else None
        ratio = f"{row['itl_p50_vs_inprocess']:.2f}" if base else "-"
        print(f"| {mode} | {c} | {row['ttft_p50_ms']:.2f} | {row['ttft_p90_ms']:.2f} | {row['itl_p50_ms']:.3f} | "
              f"{row['itl_p90_ms']:.3f} | {row['tok_s']:.0f} | {ratio} |", flush=True)
        if self.json_path is not None:
            self.json_path.write_text(json.dumps(self.rows, indent=1))

    def notes(self) -> None:
        multi = sum(r["multi_token_events"] for r in self.rows)
        busy = [f"{r['mode']}@{r['c']}" for r in self.rows
                if r["mode"] != "inprocess" and r["client_busy"] > BUSY]
        print(f"events with more than one token: {multi} (one event a token otherwise)")
        if busy:
            print(f"a client process over {BUSY:.0%} busy (its ITL is partly the client's): {', '.join(busy)}")


def warm(_: int) -> None:
    """In a client process: the SDK imported, then held long enough that each process gets one."""
    import openai  # noqa: F401
    time.sleep(0.5)


def main() -> None:
    from backends.worker.loader import resolve_model

    started, args = time.monotonic(), parse_args()
    # converted once, before any worker starts (the gateway's tokenizer)
    args.model_dir = args.model_dir or resolve_model(MODEL)
    report = Report(args)
    if "inprocess" in args.modes:
        run_inprocess(args, report)
    served = [mode for mode in args.modes if mode != "inprocess"]
    if served:
        with (tempfile.TemporaryDirectory(prefix="switchyard-gpu-serve-") as logs,
              ProcessPoolExecutor(args.client_procs, mp_context=multiprocessing.get_context("spawn")) as pool):
            list(pool.map(warm, range(args.client_procs)))
            for mode in served:
                run_served(mode, args, report, Path(logs), pool)
    report.notes()
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
