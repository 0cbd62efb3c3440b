"""Real workers replaying a slice of the Mooncake conversation trace through the real gateway, with and without
KV tiers below a small device pool (issue 14): prefix hit rate, TTFT p50/p90 and the tiers' counters.

The slice: conversations (requests sharing the trace's second block id, i.e. one session's turns, each the
previous turn's prompt plus more), sampled with a fixed seed among those with at least two turns and no prompt
over `--max-blocks` trace blocks, replayed in the trace's order. Scaled to this machine: one 512-token trace block
becomes one 16-token worker block, with token ids drawn from a generator seeded by the block's hash id (equal ids,
equal tokens; the trace's ids are themselves chained, so equal ids mean an equal prefix); a partial last block
keeps its share of 16 tokens. Each request is a streamed /v1/completions call with the token ids as its prompt and
`--max-tokens` output tokens; `--concurrency` requests at most in flight, in the trace's order, and a turn is sent
only once its session's previous turn has been answered (as a user would).

Configurations, each on two fresh workers (`--threads 1` each, `--num-blocks` small enough that the slice's
working set does not fit) behind a fresh gateway with the prefix_aware policy fed by the workers' KV events:
  none       no tier
  +ram       --kv-cpu-gb (sized below the working set too)
  +ram+disk  and --kv-disk-dir/--kv-disk-gb (room for everything)
  +ram+disk+store  and --kv-store, a fresh mooncake_master (backends/kv_connectors/tiers/mooncake_store.start_master);
             "not run" when the mooncake client or its master is not installed
Rounds alternate the configurations' order; the table gives medians over rounds. `--policy session_affinity`
(each request names its session) tells routing apart from the pool's pressure. prefix_aware weighs a block in a
tier by 1 - the restore fraction its worker measured and reports (the table shows the last round's figures);
`--fixed-tier-weights` makes it use the fixed cpu/disk/store weights instead.

    .venv/bin/python benchmarks/kv_tiers_replay.py [--rounds 2] [--requests 200] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.worker.loader import resolve_model  # noqa: E402
from kv_tiers_replay_trace import BLOCK, Turn, ideal_hit_rate, trace_slice  # noqa: E402  (beside this script)
from sse import data_chunks  # noqa: E402  (benchmarks/sse.py, beside this script)
from tests.support.gateway_proc import GatewayProcess  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.worker_proc import WorkerProcess  # noqa: E402

MODEL = "smollm2"
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4   # one SmolLM2 fp32 block: 30 layers, K and V, 3 KV heads of 64
CONFIGS = ("none", "+ram", "+ram+disk", "+ram+disk+store")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else float("nan")


# ---------------------------------------------------------------- the replay
@dataclass
class Replay:
    ttft_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_errors: int = 0
    wall_s: float = 0.0


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: tuple[int, ...], max_tokens: int,
                     headers: dict[str, str]) -> tuple[float, dict[str, Any]]:
    body = {"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    async with session.post(url, json=body, headers=headers) as resp:
        async for chunk in data_chunks(resp):
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    return (first or time.perf_counter()) - t0, usage


async def replay(base: str, turns: list[Turn], concurrency: int, max_tokens: int, session_header: bool = False
                 ) -> Replay:
    """Whenever fewer than `concurrency` requests are in flight, send the earliest turn (in the trace's order)
    whose session's previous turn has been answered. (A semaphore over one task per turn would not do: every
    session's first turn would queue ahead of every second turn, and the replay would run breadth-first.)
    `session_header`: each request names its session (x-session-affinity), for the session_affinity policy."""
    out = Replay()
    answered: set[tuple[int, int]] = set()
    pending = list(turns)
    running: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def send(turn: Turn) -> None:
            headers = {"x-session-affinity": str(turn.session)} if session_header else {}
            try:
                ttft, usage = await stream_one(session, base + "/v1/completions", turn.token_ids, max_tokens, headers)
                out.ttft_s.append(ttft)
                out.num_prompt_tokens += usage["prompt_tokens"]
                out.num_cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            except (TimeoutError, aiohttp.ClientError, KeyError) as exc:
                out.num_errors += 1
                print(f"#   request failed: {exc!r}", flush=True)
            finally:
                answered.add((turn.session, turn.index))

        t0 = time.perf_counter()
        while pending or running:
            while len(running) < concurrency:
                turn = next((t for t in pending if t.index == 0 or (t.session, t.index - 1) in answered), None)
                if turn is None:
                    break
                pending.remove(turn)
                running.add(asyncio.create_task(send(turn)))
            _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        out.wall_s = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------- one configuration
def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return orjson.loads(response.read())


def chats_served(worker: str) -> int:
    with urllib.request.urlopen(worker + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(sum(float(m.group(1)) for m in re.finditer(
        r'^switchyard_requests_total\{[^}]*route="/v1/completions"[^}]*\} (\S+)', text, re.M)))


def worker_cpu_s(port: int) -> float:
    """CPU seconds (user + system, all threads) of the worker process listening on `port`: the replay's cost in
    a form that other tenants' load on this shared machine moves much less than wall time."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            if b"backends.server" in argv and str(port).encode() in argv:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
    raise RuntimeError(f"no worker process on port {port}")


# Python logging's errors and warnings (but the pool's max_model_len notice and the gateway's start line, logged as a
# warning), tracebacks, glog's E and F lines
PROBLEM = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b|WARNING (?!.*(max_model_len|gateway listening))|^[EF]\d{4} ")


def problem(line: str) -> str:
    """A log line without its time stamp, so that repeats count together."""
    if re.match(r"[EF]\d{4} ", line):
        return "glog " + line[0] + ": " + line.split("] ", 1)[-1][:140]
    return line.split(": ", 1)[-1][:140] if re.match(r"\d{4}-", line) else line[:140]


@contextlib.contextmanager
def store_master(workdir: Path) -> Iterator[str]:
    from backends.kv_connectors.tiers.mooncake_store import start_master, wait_ready
    port = free_port()
    proc = start_master(port, metrics_port=free_port(), log_path=workdir / "mooncake_master.log")
    try:
        wait_ready(proc, port)
        yield f"mooncake://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def worker_args(config: str, args: argparse.Namespace, workdir: Path, i: int, store_url: str | None) -> list[str]:
    out = ["--model", MODEL, "--served-model-name", MODEL, "--threads", "1", "--num-blocks", str(args.num_blocks),
           "--max-num-seqs", "8"]
    if "ram" in config:
        out += ["--kv-cpu-gb", f"{args.ram_blocks * BLOCK_BYTES / 2**30:.6f}"]
    if "disk" in config:
        out += ["--kv-disk-dir", str(workdir / f"disk{i}"), "--kv-disk-gb", f"{args.disk_gb}"]
    if store_url is not None:
        out += ["--kv-store", store_url]
    return out


def run_config(config: str, args: argparse.Namespace, turns: list[Turn], model_dir: Path) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"kv-replay-{config.strip('+').replace('+', '-')}-", dir="/var/tmp"))
    with contextlib.ExitStack() as stack:
        store_url = stack.enter_context(store_master(workdir)) if "store" in config else None
        starting = [WorkerProcess(worker_args(config, args, workdir, i, store_url), log_dir=workdir, wait=False)
                    for i in range(2)]
        for w in starting:
            stack.callback(w.stop)
        for w in starting:
            w.wait_healthy()
        urls = [w.url for w in starting]
        gateway_config = {
            "models": {MODEL: {"tokenizer": str(model_dir), "providers": ["local"],
                               "policy": policy_config(args)}},
            "providers": {"local": {"kind": "openai", "endpoints": urls, "offers_load": True,
                                    "offers_kv_events": True}},
            "pollers": {"health_interval_s": 0.5, "load_interval_s": 0.1, "kv_events_interval_s": 0.1},
            "log_level": "WARNING",
        }
        gateway = GatewayProcess(gateway_config, workdir)
        stack.callback(gateway.stop)
        for url in urls:   # the first forward of a process is slow: not in the figures
            asyncio.run(replay(url, [Turn(-1, 0, tuple(range(1000, 1010)))], 1, 2))
        cpu_before = sum(worker_cpu_s(w.port) for w in starting)
        result = asyncio.run(replay(gateway.url, turns, args.concurrency, args.max_tokens,
                                    args.policy == "session_affinity"))
        cpu_s = sum(worker_cpu_s(w.port) for w in starting) - cpu_before
        loads = [get_json(url + "/load") for url in urls]
        served = [chats_served(url) - 1 for url in urls]
        tiers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        fractions: dict[str, list[float | None]] = collections.defaultdict(list)   # per medium, each worker's
        for load in loads:
            for t in load["kv_tiers"]:
                tiers[t["medium"]].update(restored=t["num_restored_blocks"], written=t["num_written_blocks"],
                                          failed=t["num_failed_writes"], held=max(0, t["num_blocks"]))
                fractions[t["medium"]].append(t.get("restore_fraction"))
        dropped = sum(load["num_kv_dropped_writes"] for load in loads)
        not_freed = sum(load["num_total_blocks"] - load["num_free_blocks"] for load in loads)   # 0 once idle
        gateway_log = gateway.log()
    logs = [w.log_path.read_text(errors="replace") for w in starting]
    problems = collections.Counter(problem(line) for log in [*logs, gateway_log] for line in log.splitlines()
                                   if re.search(PROBLEM, line))
    shutil.rmtree(workdir, ignore_errors=True)
    return {"replay": result, "cpu_s": cpu_s, "served": served, "tiers": dict(tiers), "dropped": dropped,
            "not_freed": not_freed, "problems": problems, "fractions": dict(fractions)}


def policy_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.policy == "prefix_aware" and args.fixed_tier_weights:
        return {"name": args.policy, "options": {"measured_tier_weights": False}}
    return {"name": args.policy}


def restore_fractions(run: dict[str, Any]) -> str:
    """Each medium's restore fraction as each worker last reported it ("?": not measured)."""
    def one(value: float | None) -> str:
        return "?" if value is None else f"{value:.3f}"

    return " / ".join(",".join(one(v) for v in run["fractions"][m]) if m in run["fractions"] else "–"
                      for m in ("cpu", "disk", "store"))


# ---------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="at least this many requests (whole sessions)")
    ap.add_argument("--max-blocks", type=int, default=40, help="sessions with a longer prompt are left out")
    ap.add_argument("--seed", type=int, default=0, help="which sessions")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=96, help="each worker's device pool")
    ap.add_argument("--ram-blocks", type=int, default=64, help="each worker's RAM tier, in blocks")
    ap.add_argument("--disk-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--policy", default="prefix_aware", choices=["prefix_aware", "session_affinity"],
                    help="the gateway's; with session_affinity each request names its session")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--fixed-tier-weights", action="store_true",
                    help="prefix_aware with measured_tier_weights off (the fixed 0.8/0.5/0.3)")
    args = ap.parse_args()

    configs = list(args.configs)
    if "+ram+disk+store" in configs:
        try:
            from backends.kv_connectors.tiers.mooncake_store import master_path
            __import__("mooncake.store")
            master_path()
        except (ImportError, RuntimeError) as exc:
            print(f"# +store: not run (TODO: {exc})")
            configs.remove("+ram+disk+store")
    model_dir = resolve_model(MODEL)
    turns = trace_slice(args.requests, args.max_blocks, args.seed)
    num_blocks = sum(-(-len(t.token_ids) // BLOCK) for t in turns)
    print(f"# {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC | {os.cpu_count()} cores | load average "
          f"{os.getloadavg()[0]:.1f} | {len(turns)} requests of {len({t.session for t in turns})} sessions, "
          f"{sum(len(t.token_ids) for t in turns)} prompt tokens ({num_blocks} blocks, longest "
          f"{max(len(t.token_ids) for t in turns)} tokens), {args.max_tokens} out | unbounded-cache hit rate "
          f"{ideal_hit_rate(turns):.3f} | per worker: {args.num_blocks} device blocks, RAM tier {args.ram_blocks} "
          f"blocks, disk {args.disk_gb} GiB | concurrency {args.concurrency} | policy {args.policy}"
          f"{' (fixed tier weights)' if args.fixed_tier_weights else ''}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            t0 = time.perf_counter()
            res = run_config(config, args, turns, model_dir)
            runs[config].append(res)
            rep = res["replay"]
            print(f"#   round {r} {config:16s} hit {rep.num_cached_tokens / rep.num_prompt_tokens:.3f}  TTFT p50 "
                  f"{1e3 * pct(rep.ttft_s, 50):6.0f} p90 {1e3 * pct(rep.ttft_s, 90):6.0f} ms  replay "
                  f"{rep.wall_s:5.1f} s, workers' CPU {res['cpu_s']:5.1f} s (config {time.perf_counter() - t0:5.1f} "
                  f"s)  served {res['served']}  errors {rep.num_errors}  tiers {res['tiers']}  dropped writes "
                  f"{res['dropped']}  device blocks not free once idle {res['not_freed']}  restore fractions "
                  f"{restore_fractions(res)}", flush=True)
            for line, n in res["problems"].most_common(8):
                print(f"#     log x{n}: {line}")
    report(runs, configs)


def tier_counts(run: dict[str, Any], key: str) -> str:
    return " / ".join(str(run["tiers"][m][key]) if m in run["tiers"] else "–" for m in ("cpu", "disk", "store"))


def report(runs: dict[str, list[dict[str, Any]]], configs: list[str]) -> None:
    def med(config: str, f: Any) -> float:
        return statistics.median(f(res) for res in runs[config])

    print("\n| configuration | prefix hit rate | TTFT p50 ms | TTFT p90 ms | replay s | workers' CPU s "
          "| requests per worker | restored blocks (cpu/disk/store) | written blocks (cpu/disk/store) "
          "| failed writes (cpu/disk/store) | dropped writes | errors | restore fraction per worker (cpu/disk/store) |")
    print("|---" * 13 + "|")
    for config in CONFIGS:
        if config not in configs:
            print(f"| {config} | not run | | | | | | | | | | | |")
            continue
        last = runs[config][-1]
        cells = [f"{med(config, lambda r: r['replay'].num_cached_tokens / r['replay'].num_prompt_tokens):.3f}",
                 f"{med(config, lambda r: 1e3 * pct(r['replay'].ttft_s, 50)):.0f}",
                 f"{med(config, lambda r: 1e3 * pct(r['replay'].ttft_s, 90)):.0f}",
                 f"{med(config, lambda r: r['replay'].wall_s):.1f}", f"{med(config, lambda r: r['cpu_s']):.1f}",
                 str(last["served"]), tier_counts(last, "restored"), tier_counts(last, "written"),
                 tier_counts(last, "failed"), str(last["dropped"]), str(last["replay"].num_errors),
                 restore_fractions(last)]
        print(f"| {config} | " + " | ".join(cells) + " |")
    print("(medians over rounds; the counters are the last round's, summed over both workers)")


if __name__ == "__main__":
    main()
