"""A switchyard worker beside vLLM's CPU engine and transformers' `generate`, in one run.

The six scenarios of issue 18: 256-token prompts and 128 output tokens, streamed, at 1, 8 and 32
concurrent clients, with unique prompts and with a shared 200-token prefix. The engines alternate
(`--rounds` passes, the order flipping each pass) and the table gives each scenario's median over
the passes. Prompts go in as token ids to /v1/completions, so both engines see the same tokens.
vLLM comes from `make vllm-setup` (.venv-vllm); `--engines switchyard` leaves it out. A script,
not a test:

    .venv/bin/python benchmarks/worker_bench.py [--rounds 2] [--concurrency 1 8 32] [--worker-args '--dtype bfloat16']

Two checkouts against each other (`--worker-tree before=../old --worker-tree after=.`, repeatable): each adds an
engine NAME, the worker run with cwd=DIR (so that checkout's packages are imported; the same Python); with trees,
`--engines` defaults to the trees alone, and a last table gives each tree against the first one named.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.server.__main__ import resolve_dtype  # noqa: E402
from backends.worker.loader import resolve_model  # noqa: E402
from bench_trees import check_trees, ratio_cell, spread, tree_option  # noqa: E402  (beside this script)
from sse import data_chunks  # noqa: E402  (benchmarks/sse.py, beside this script)
from tests.support.ports import free_port  # noqa: E402

MODEL = "smollm2"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]



# ---------------------------------------------------------------- workload
@dataclass(frozen=True)
class Scenario:
    concurrency: int
    shared: bool
    requests: int = 64   # per concurrent scenario (a single stream sends 4)

    @property
    def name(self) -> str:
        return f"{self.concurrency} concurrent, {'shared prefix' if self.shared else 'unique'}"

    def num_requests(self) -> int:
        return 4 if self.concurrency == 1 else max(self.concurrency, self.requests)


def prompts(scenario: Scenario, vocab: list[int], prompt_tokens: int, shared_tokens: int, salt: str) -> list[list[int]]:
    """Token-id prompts: random ordinary tokens, the first `shared_tokens` the same for all when shared.
    `salt` keeps one pass's prompts from hitting the cache a previous pass filled."""
    rng = random.Random(f"{scenario.name}/{salt}")
    prefix = random.Random("shared-prefix").choices(vocab, k=shared_tokens) if scenario.shared else []
    return [prefix + rng.choices(vocab, k=prompt_tokens - len(prefix)) for _ in range(scenario.num_requests())]


def ordinary_vocab(model_dir: Path) -> list[int]:
    """Ids of plain-word tokens (no specials, no byte pieces), so random prompts stay in-distribution."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    return [i for t, i in tok.get_vocab().items() if i not in special and t.lstrip("Ġ").isalpha() and len(t) > 2]


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], new_tokens: int
                     ) -> tuple[float, list[float], int]:
    """One streaming completion: (ttft_s, gaps between text chunks, completion tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with session.post(url, json=body) as resp:
        async for chunk in data_chunks(resp):
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)], tokens


async def run_scenario(base: str, scenario: Scenario, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    url = base + "/v1/completions"
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = 0
    todo = list(batch)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()

        async def client() -> None:
            nonlocal tokens
            while todo:
                ttft, g, n = await stream_one(session, url, todo.pop(), new_tokens)
                ttfts.append(ttft)
                gaps.extend(g)
                tokens += n

        await asyncio.gather(*(client() for _ in range(scenario.concurrency)))
        wall = time.perf_counter() - t0
    return {"ttft_p50_ms": 1e3 * pct(ttfts, 50), "itl_p50_ms": 1e3 * pct(gaps, 50),
            "itl_p90_ms": 1e3 * pct(gaps, 90), "tok_s": tokens / wall}


# ---------------------------------------------------------------- the engines
def wait_healthy(proc: subprocess.Popen, url: str, what: str, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{what} did not become healthy in {timeout_s:.0f} s")


def start_switchyard(port: int, extra: list[str], checkout: Path = ROOT) -> subprocess.Popen:
    """The worker of the checkout `checkout` (run there, so its packages are the ones imported)."""
    cmd = [sys.executable, "-m", "backends.server", "--model", MODEL, "--port", str(port), *extra]
    return subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def vllm_dtype(choice: str) -> str:
    """vLLM's best setting here: what our worker's `--dtype auto` picks on this CPU (bfloat16 where the CPU multiplies
    it natively, float32 elsewhere)."""
    return resolve_dtype(choice, "cpu")


def start_vllm(port: int, python: str, model_dir: Path, log: Path, dtype: str) -> subprocess.Popen:
    cores = os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", "2048"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_engine(engine: str, args: argparse.Namespace, model_dir: Path, scenarios: list[Scenario],
               vocab: list[int], salt: str) -> dict[Scenario, dict[str, float]]:
    port = free_port()
    if engine == "vllm":
        proc = start_vllm(port, args.vllm_python, model_dir, Path(args.log_dir) / f"vllm-{salt}.log",
                          vllm_dtype(args.vllm_dtype))
    else:
        proc = start_switchyard(port, args.worker_args.split(), dict(args.worker_tree).get(engine, ROOT))
    base = f"http://127.0.0.1:{port}"
    results = {}
    try:
        wait_healthy(proc, base, engine)
        warm = Scenario(1, False)
        asyncio.run(run_scenario(base, warm, prompts(warm, vocab, args.prompt_tokens, 0, "warm-up")[:2], 8))
        for sc in scenarios:
            batch = prompts(sc, vocab, args.prompt_tokens, args.shared_tokens, salt)
            if sc.shared:   # the shared prefix is in the cache before the clock starts, on both engines
                asyncio.run(run_scenario(base, Scenario(1, True), batch[:1], 1))
            results[sc] = asyncio.run(run_scenario(base, sc, batch, args.new_tokens))
            r = results[sc]
            print(f"#   {engine:10s} {sc.name:28s} {r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.0f} ms  "
                  f"ITL p50 {r['itl_p50_ms']:5.1f} ms", flush=True)
    finally:
        stop(proc)
    return results


# ---------------------------------------------------------------- transformers baseline
def hf_baseline(model_dir: Path, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Batch-1 greedy `generate` on the unique prompts: decode tok/s and TTFT."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ttfts, decode_s, decode_tokens = [], 0.0, 0
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([batch[0]]), max_new_tokens=4, min_new_tokens=4, **kwargs)   # warm-up
        for ids in batch:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kwargs)
            t1 = time.perf_counter()
            model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            t2 = time.perf_counter()
            ttfts.append(t1 - t0)
            decode_s += (t2 - t1) - (t1 - t0)
            decode_tokens += new_tokens - 1
    return {"ttft_p50_ms": 1e3 * pct(ttfts, 50), "tok_s": decode_tokens / decode_s}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--shared-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrent scenario")
    ap.add_argument("--engines", nargs="+", default=None,
                    help="switchyard, vllm and the --worker-tree names (default: the trees, else switchyard vllm)")
    ap.add_argument("--worker-tree", type=tree_option, action="append", default=[], metavar="NAME=DIR",
                    help="one more engine NAME: the switchyard worker run from the checkout DIR; repeatable")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--vllm-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU has AVX512-BF16 or AMX, float32 elsewhere")
    ap.add_argument("--worker-args", default="", help="extra worker flags, e.g. '--dtype bfloat16'")
    ap.add_argument("--log-dir", default="/tmp")
    args = ap.parse_args()
    trees = [name for name, _ in args.worker_tree]
    args.engines = args.engines or trees or ["switchyard", "vllm"]
    unknown = set(args.engines) - {"switchyard", "vllm", *trees}
    if unknown or len(set(args.engines)) != len(args.engines):
        ap.error(f"--engines {' '.join(args.engines)}: each once, among switchyard, vllm and the trees {trees}")
    check_trees(args.worker_tree, "backends")
    return args


def main() -> None:
    args = parse_args()
    model_dir = resolve_model(MODEL)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} | {cpu} ({isa}) | {os.cpu_count()} cores | torch {torch.__version__} "
          f"| vLLM {vllm_dtype(args.vllm_dtype)} | {args.prompt_tokens}-token prompts, {args.new_tokens} out "
          f"| worker args: {args.worker_args or '-'}")
    vocab = ordinary_vocab(model_dir)
    scenarios = [Scenario(c, s, args.requests) for s in (False, True) for c in args.concurrency]
    passes: dict[str, list[dict[Scenario, dict[str, float]]]] = {e: [] for e in args.engines}
    for r in range(args.rounds):
        for engine in (args.engines if r % 2 == 0 else args.engines[::-1]):
            passes[engine].append(run_engine(engine, args, model_dir, scenarios, vocab, f"round{r}"))
    print_table(args.engines, scenarios, passes)
    print_tree_ratios([name for name, _ in args.worker_tree if name in args.engines], scenarios, passes)
    if not args.no_hf:
        batch = prompts(Scenario(1, False), vocab, args.prompt_tokens, 0, "hf")[:3]
        hf = hf_baseline(model_dir, batch, args.new_tokens)
        print(f"\ntransformers generate, batch 1, fp32: {hf['tok_s']:.1f} decode tok/s, "
              f"TTFT p50 {hf['ttft_p50_ms']:.0f} ms")
    print(f"(medians over {args.rounds} passes per engine; TTFT ratio below 1 is switchyard faster)")


Passes = dict[str, list[dict[Scenario, dict[str, float]]]]  # per engine, per pass: each scenario's figures


def print_table(engines: list[str], scenarios: list[Scenario], passes: Passes) -> None:
    def med(engine: str, sc: Scenario, key: str) -> float:
        return statistics.median(p[sc][key] for p in passes[engine])

    against_vllm = sorted(engines) == ["switchyard", "vllm"]
    print("\n| scenario | " + " | ".join(f"{e} out tok/s | {e} TTFT p50 ms | {e} ITL p50 / p90 ms" for e in engines)
          + (" | switchyard / vllm tok/s | TTFT ratio |" if against_vllm else " |"))
    print("|---" * (1 + 3 * len(engines) + (2 if against_vllm else 0)) + "|")
    for sc in scenarios:
        cells = [f"{med(e, sc, 'tok_s'):.1f} | {med(e, sc, 'ttft_p50_ms'):.0f} | {med(e, sc, 'itl_p50_ms'):.1f}"
                 f" / {med(e, sc, 'itl_p90_ms'):.1f}" for e in engines]
        ratio = ""
        if against_vllm:
            ratio = (f" | {med('switchyard', sc, 'tok_s') / med('vllm', sc, 'tok_s'):.2f}"
                     f" | {med('switchyard', sc, 'ttft_p50_ms') / med('vllm', sc, 'ttft_p50_ms'):.2f}")
        print(f"| {sc.name} | " + " | ".join(cells) + ratio + " |")


def print_tree_ratios(trees: list[str], scenarios: list[Scenario], passes: Passes) -> None:
    """Each tree after the first against the first, per scenario: the ratio of the medians and, in brackets,
    the lowest and highest ratio of the same pass's figures; then each tree's spread between passes."""
    if len(trees) < 2:
        return
    first = trees[0]
    keys = (("tok/s", "tok_s"), ("TTFT p50", "ttft_p50_ms"), ("ITL p50", "itl_p50_ms"))
    print(f"\ntrees against {first} (ratio of medians; in brackets the lowest and highest ratio within a pass)")
    for name in trees[1:]:
        for sc in scenarios:
            cells = [ratio_cell(label, [p[sc][key] for p in passes[name]], [p[sc][key] for p in passes[first]])
                     for label, key in keys]
            print(f"{name}/{first} {sc.name}: " + ", ".join(cells))
    print("spread between passes of out tok/s and TTFT p50, (highest - lowest) / median:")
    for name in trees:
        cells = [f"{sc.name} {spread([p[sc]['tok_s'] for p in passes[name]]):.0%}"
                 f"/{spread([p[sc]['ttft_p50_ms'] for p in passes[name]]):.0%}" for sc in scenarios]
        print(f"  {name}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
