"""What loading a prefix back from a KV tier costs against recomputing it (issue 14, target: a restored token
costs at most 1/5 of a recomputed one on this CPU). In process, on the real SmolLM2: one `LLMEngine` per tier
(host RAM, local disk, and the Mooncake store when its client imports), each over its own model runner and a
small device pool, stepped in this thread as the worker's step thread does; a sequence waiting for its load
waits on the loader's wake-up, not on a timer.

For a prompt of P tokens (a prefix of P - 16 tokens and a 16-token suffix of its own), the time from
`add_request` to the first token, with max_tokens 1:
  cold    nothing cached: the whole prompt is computed;
  device  the prefix is a device-pool hit: only the suffix is computed;
  tier    the prefix was evicted from the pool (two fresh filler prompts) into the tier and is loaded back.
          This is what a restore costs in a full pool: the fillers' blocks that its own allocation evicts are
          written down meanwhile (copied out in the engine thread, put by the writer thread);
  nothing to write down (RAM, disk): the same after the two fixed fillers, whose blocks the tier holds
          already, so that the restore's evictions write nothing: the read alone;
  cold page cache (disk): the same again after the prefix's block files were written back and dropped from
          the page cache (fsync + POSIX_FADV_DONTNEED on each file: no global drop_caches on a shared machine).
Restore cost per token = (tier - device) / prefix tokens; recompute cost per token = (cold - device) / prefix
tokens; their ratio is taken per repetition (cold, device and tier measured back to back on one engine) and the
table gives medians. Repetitions alternate the engines and rotate their order.

    .venv/bin/python benchmarks/kv_restore_cost.py [--prompt-tokens 256 1024] [--reps 7] [--threads 1]
        [--tiers cpu disk store]

On a GPU (the host tier then lives in pinned buffers), with random weights of a model whose weights are not
at hand (a step takes as long whatever the values; the restored bytes are the same size):

    python3 benchmarks/kv_restore_cost.py --device cuda --dtype bfloat16 --model smollm2-shape --tiers cpu disk
        (or --model llama3-8b)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.core.engine_config import EngineConfig  # noqa: E402
from backends.core.sampling_params import SamplingParams  # noqa: E402
from backends.engine.engine import LLMEngine  # noqa: E402
from backends.kv_connectors.tiers.connector import TieredKVConnector  # noqa: E402
from backends.worker.loader import resolve_model  # noqa: E402
from cache.block_hash import block_hashes  # noqa: E402

BLOCK = 16
SUFFIX = 16                       # the prompt's own tokens after the shared prefix: one block
TARGET = 1 / 5                    # issue 14: restore at most 1/5 of recompute, per token
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
FIXED_FILLERS = "fixed"           # the fillers whose blocks, once a tier holds them, are only ever restored


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


@dataclass
class TierEngine:
    """One engine with one tier below its device pool, and the event its loader thread sets."""
    medium: str
    engine: LLMEngine
    pool_blocks: int
    woken: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.engine.set_wake(self.woken.set)

    @property
    def tiers(self) -> TieredKVConnector:
        tiers = self.engine.find_kv_connector(TieredKVConnector)
        assert tiers is not None, "the engine has no KV tiers"
        return tiers

    @property
    def tier(self) -> Any:
        return self.tiers.tiers[0]

    def restored(self) -> int:
        return sum(self.tiers.restored.values())

    def run(self) -> list[Any]:
        """Step until idle; a step that ran nothing (a sequence waits for its load) waits for the wake-up."""
        outs = []
        while self.engine.has_unfinished():
            steps = self.engine.num_steps
            outs.extend(self.engine.step())
            if self.engine.num_steps == steps:
                if not self.woken.wait(timeout=60):
                    raise RuntimeError(f"{self.medium}: a KV tier load never ended")
                self.woken.clear()
        return outs

    def first_token(self, request_id: str, prompt: list[int]) -> tuple[float, int]:
        """(seconds from add_request to the first token, prompt tokens the engine did not compute)."""
        t0 = time.perf_counter()
        self.engine.add_request(request_id, prompt, ONE_TOKEN)
        outs = self.run()
        return time.perf_counter() - t0, outs[-1].num_cached_tokens

    def evict_all(self, salt: str) -> None:
        """Two fillers of half the pool each: every block cached before them is evicted (the least recently
        freed first, so the second filler takes what the first left)."""
        n = (self.pool_blocks // 2 + 1) * BLOCK
        for i in range(2):
            self.engine.add_request(f"filler-{salt}-{i}", tokens(zlib.crc32(f"{salt}/{i}".encode()), n), ONE_TOKEN)
            self.run()

    def restore(self, request_id: str, prompt: list[int]) -> tuple[float, int]:
        """(first-token time, blocks restored from the tier) of a prompt whose prefix the tier holds."""
        before = self.restored()
        ttft_s, _ = self.first_token(request_id, prompt)
        return ttft_s, self.restored() - before

    def wait_writes_idle(self, quiet_s: float = 0.3) -> None:
        """Until the tier's written count has not moved for `quiet_s` (the writer thread is done)."""
        last, since = -1, time.monotonic()
        while time.monotonic() - since < quiet_s:
            now = sum(self.tiers.written.values())
            if now != last:
                last, since = now, time.monotonic()
            time.sleep(0.02)

    def wait_tier_holds(self, hashes: list[int], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tier.leading_hits(hashes) < len(hashes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.medium}: the tier holds {self.tier.leading_hits(hashes)} of "
                                   f"{len(hashes)} prefix blocks after {timeout_s} s")
            time.sleep(0.01)


def make_engine(medium: str, pool_blocks: int, model_dir: Path, workdir: Path, store_url: str | None,
                args: argparse.Namespace) -> TierEngine:
    kw: dict[str, Any] = {}
    if medium == "cpu":
        kw["kv_cpu_bytes"] = 2 << 30
    elif medium == "disk":
        kw.update(kv_disk_dir=str(workdir / "disk"), kv_disk_bytes=4 << 30)
    else:   # a pool the repetitions' fresh prefixes and fillers do not fill within the master's read lease
        kw.update(kv_store=store_url, kv_store_bytes=2 << 30)
    config = EngineConfig(model_dir=str(model_dir), block_size=BLOCK, num_blocks=pool_blocks, device=args.device,
                          dtype=args.dtype, kv_write_queue_blocks=512, torch_num_threads=args.threads,
                          kv_read_slower_tiers=True, **kw)   # every restore is measured, even one slower than computing
    runner = None
    if args.model != "smollm2":    # random weights: a folder with the config alone
        from backends.worker.model_runner import ModelRunner
        runner = ModelRunner(model_dir, dtype=getattr(torch, args.dtype), device=args.device, num_blocks=pool_blocks,
                             block_size=BLOCK, random_weights=True, fingerprint_weights=True)
    return TierEngine(medium, LLMEngine(config, runner=runner, model_dir=model_dir), pool_blocks)


# SmolLM2-135M's shape (its config.json), for a machine without the model package
SMOLLM2_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                 "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                 "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def model_folder(name: str, workdir: Path) -> Path:
    """The bundled SmolLM2, or a folder holding only a config.json (its weights are drawn at random)."""
    if name == "smollm2":
        return resolve_model("smollm2")
    from benchmarks.gpu_bench import LLAMA3_8B

    folder = workdir / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B if name == "llama3-8b" else SMOLLM2_SHAPE))
    return folder


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "the CPU"


# ---------------------------------------------------------------- page cache
def resident_fraction(paths: list[Path]) -> float:
    """Of these files' bytes, the fraction in the page cache (util-linux's fincore); NaN without it."""
    if shutil.which("fincore") is None:
        return float("nan")
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", *map(str, paths)],
                         check=True, capture_output=True, text=True).stdout.split()
    resident, size = sum(map(int, out[0::2])), sum(map(int, out[1::2]))
    return resident / size if size else 0.0


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)                   # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- one repetition
def measure(te: TierEngine, prompt_tokens: int, rep: str, seed: int) -> dict[str, float]:
    """Times (s) for one fresh prefix on one engine: cold, device, and restores (with `*_blocks` the blocks each
    restored). "tier": after fresh fillers, whose blocks the restore's allocation evicts and writes down; "alone"
    (local tiers): after the fixed fillers, whose blocks the tier holds already, so that nothing is written down
    during the restore; "disk_cold": the same with the prefix's files out of the page cache."""
    prefix = tokens(seed, prompt_tokens - SUFFIX)
    hashes = block_hashes(prefix, BLOCK)
    suffix = [tokens(seed + 1 + i, SUFFIX) for i in range(5)]
    r: dict[str, float] = {}
    r["cold"], cached = te.first_token(f"cold-{rep}", prefix + suffix[0])
    assert cached == 0, f"{te.medium}: a fresh prompt hit {cached} tokens"
    r["device"], cached = te.first_token(f"device-{rep}", prefix + suffix[1])
    assert cached == len(prefix), f"{te.medium}: device hit of {cached} tokens, not {len(prefix)}"
    te.evict_all(rep)
    te.wait_tier_holds(hashes)
    r["tier"], r["tier_blocks"] = te.restore(f"tier-{rep}", prefix + suffix[2])
    if te.medium == "store":          # the store is written when a block is cached: no write-down to leave out
        return r
    te.evict_all(FIXED_FILLERS)
    te.wait_writes_idle()
    r["alone"], r["alone_blocks"] = te.restore(f"alone-{rep}", prefix + suffix[3])
    if te.medium == "disk":
        te.evict_all(FIXED_FILLERS)
        te.wait_writes_idle()
        files = [te.tier._path(h) for h in hashes]
        drop_page_cache(files)
        r["resident_after_drop"] = resident_fraction(files)
        r["disk_cold"], r["disk_cold_blocks"] = te.restore(f"disk-cold-{rep}", prefix + suffix[4])
    return r


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tiers", nargs="+", default=["cpu", "disk", "store"], choices=["cpu", "disk", "store"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: with 2 on this 2-core VM, another tenant's process on one core "
                         "stalls every OpenMP barrier and steps take 5-10x as long)")
    ap.add_argument("--workdir", default=None, help="where the disk tier writes (default: a new folder in /var/tmp)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the host tier's buffers are then pinned")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "smollm2-shape", "llama3-8b"],
                    help="smollm2-shape, llama3-8b: that model's shape with random weights (for a GPU)")
    return ap.parse_args()


def print_header(args: argparse.Namespace, pool_blocks: int, workdir: Path) -> None:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    print(f"# {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC | {cpu} | {os.cpu_count()} cores | torch "
          f"{torch.__version__} | {args.model}, {args.dtype} on {device_name(args.device)}, {args.threads} torch "
          f"thread(s) | device pool {pool_blocks} blocks of {BLOCK} "
          f"| load average {os.getloadavg()[0]:.1f} | disk tier in {workdir}", flush=True)


def start_store(tiers: list[str], workdir: Path) -> tuple[subprocess.Popen | None, str | None]:
    """A Mooncake master for the store tier, if asked for and it starts; else "store" leaves `tiers`."""
    if "store" not in tiers:
        return None, None
    try:
        from backends.kv_connectors.tiers.mooncake_store import start_master, wait_ready
        from tests.support.ports import free_port
        port = free_port()
        master = start_master(port, metrics_port=free_port(), log_path=workdir / "mooncake_master.log")
        wait_ready(master, port)
        return master, f"mooncake://127.0.0.1:{port}"
    except (ImportError, RuntimeError) as exc:
        print(f"# store: not run ({exc})")
        tiers.remove("store")
        return None, None


def run_reps(engines: list[TierEngine], args: argparse.Namespace) -> dict[tuple[int, str], list[dict[str, float]]]:
    """Every prompt length on every tier, `--reps` times (each rep starting at another tier), printed as it goes."""
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    for rep in range(-1, args.reps):          # rep -1 warms every shape up and is not counted
        for i, P in enumerate(args.prompt_tokens):
            k = (rep + i) % len(engines)
            for te in engines[k:] + engines[:k]:
                r = measure(te, P, f"{rep}-{P}-{te.medium}", 1000 * (rep + 2) + 10 * P + len(te.medium))
                if rep < 0:
                    continue
                results.setdefault((P, te.medium), []).append(r)
                times = "  ".join(f"{k} {1e3 * r[k]:.1f}" + (f" ({r[k + '_blocks']:.0f} blocks)" if k != "cold"
                                                             and k != "device" else "")
                                  for k in ("cold", "device", "tier", "alone", "disk_cold") if k in r)
                resident = f"; resident after the drop {r['resident_after_drop']:.0%}" if "disk_cold" in r else ""
                print(f"#  rep {rep} P {P:5d} {te.medium:5s} {times} ms{resident}", flush=True)
    return results


def main() -> None:
    args = parse_args()
    pool_blocks = max(args.prompt_tokens) // BLOCK + 8
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kv-restore-", dir="/var/tmp"))
    model_dir = model_folder(args.model, workdir)
    torch.set_num_threads(args.threads)     # as the worker's step thread does (AsyncEngine)
    print_header(args, pool_blocks, workdir)

    tiers = list(args.tiers)
    master, store_url = start_store(tiers, workdir)
    engines = [make_engine(m, pool_blocks, model_dir, workdir, store_url, args) for m in tiers]
    for te in engines:   # the fixed fillers' blocks are computed once; later evictions write them down
        te.evict_all(FIXED_FILLERS)
    gc.freeze()
    try:
        results = run_reps(engines, args)
        for te in engines:   # every block free again once idle, and the block manager's books agree
            te.engine.block_manager.check_invariants()
            print(f"# {te.medium}: {te.engine.block_manager.num_free_blocks} of {te.pool_blocks} device blocks free "
                  f"once idle; {te.tiers.num_dropped_writes} dropped writes, "
                  f"{te.tiers.num_load_errors} load errors")
    finally:
        for te in engines:
            te.engine.close()
        if master is not None:
            master.kill()
            master.wait()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report(results, args.prompt_tokens, tiers, args.reps)

ROWS = (("tier", ""), ("alone", ", nothing to write down"), ("disk_cold", ", nothing to write down, cold page cache"))


def report(results: dict[tuple[int, str], list[dict[str, float]]], sizes: list[int], tiers: list[str],
           reps: int) -> None:
    print(f"\nmedians over {reps} repetitions; ratio = restore / recompute per prefix token, per repetition, "
          f"then the median (target <= {TARGET:.2f})\n")
    print("| prompt tokens | prefix tokens | restored from | TTFT device hit ms | TTFT from tier ms | TTFT cold ms "
          "| restore us/token | recompute us/token | restore / recompute | target met |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for P in sizes:
        n = P - SUFFIX
        for medium in tiers:
            rs = results.get((P, medium), [])
            for key, label in ROWS:
                if not any(key in r for r in rs):
                    continue
                full = [r for r in rs if r[key + "_blocks"] == n // BLOCK]
                note = "" if len(full) == len(rs) else f" ({len(full)} of {len(rs)} fully restored)"
                if not full:
                    print(f"| {P} | {n} | {medium}{label}{note} | – | – | – | – | – | – | – |")
                    continue
                med = {k: statistics.median(r[k] for r in full) for k in ("cold", "device", key)}
                ratio = statistics.median((r[key] - r["device"]) / (r["cold"] - r["device"]) for r in full)
                print(f"| {P} | {n} | {medium}{label}{note} | {1e3 * med['device']:.1f} | {1e3 * med[key]:.1f} | "
                      f"{1e3 * med['cold']:.1f} | {1e6 * (med[key] - med['device']) / n:.1f} | "
                      f"{1e6 * (med['cold'] - med['device']) / n:.1f} | {ratio:.3f} | "
                      f"{'yes' if ratio <= TARGET else '**no**'} |")


if __name__ == "__main__":
    main()
