"""Worker cold start against reading the same bytes from disk, in one run (issue 48 §8; docs/benchmarks.md).

Writes a random bfloat16 checkpoint of a real shape (Llama-3.2-3B's: hidden 3072, MLP 8192, 24 query heads over 8
KV heads of 128, tied embeddings; `--layers` of its 28 layers, ~6 GB at 28) in transformers' sharded layout, with
SmolLM2's tokenizer (the bundled model's converted folder) and its vocabulary of 49,152. Then, for each
`--tensor-parallel-size` and round, each from a cold page cache (every checkpoint file's pages evicted with
posix_fadvise(DONTNEED), or the whole cache dropped with --drop-caches; a file still resident afterwards is
reported, and the run then says warm):

- read: the checkpoint's bytes read from disk by as many threads as the group has ranks (each a contiguous
  1/N of every file), the baseline;
- ready: spawn `switchyard worker --model DIR --dtype bfloat16` to its first /health 200 (the app serves only once
  the engine has loaded the model and allocated its KV cache);
- fixed: the same start on a tiny checkpoint of the same family (the same layers, heads and KV cache, hidden 64):
  imports, server, tokenizer, building the modules, the KV cache, warm-up, and at TP>1 the ranks' spawn and
  rendezvous.

One untimed start on the tiny checkpoint first (a fresh checkout's first start also compiles its bytecode).

Prints the medians, (ready - fixed) / read against the target of 1.5, the bytes each process fetched from storage
(/proc/PID/io read_bytes, the worker and its ranks) and the phases of the slowest-to-median start from the
worker's own log. A script, not a test:

    .venv/bin/python benchmarks/cold_start.py [--layers 28] [--runs 3] [--tensor-parallel-sizes 1 2]
        [--dir DIR] [--drop-caches] [--baseline-checkout DIR]

Without --dir the checkpoints go to a temporary folder that is deleted at the end; with it they are kept and
reused by the next run with the same --layers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.models.model_config import load_model_config  # noqa: E402
from backends.worker.loader import SHARD_INDEX_FILE, checkpoint_files, resolve_model  # noqa: E402
from backends.worker.random_weights import RandomCheckpoint  # noqa: E402
from moe_bench import machine  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from worker_bench import stop  # noqa: E402  (its SIGTERM, then SIGKILL, of a worker's process group)

TARGET = 1.5
# Llama-3.2-3B's shape; the vocabulary is SmolLM2's, whose tokenizer is the one here.
LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                head_dim=128, num_hidden_layers=28)
# The same layers, heads and KV cache over a hidden size of 64: the same modules to build and KV blocks to allocate,
# ~1/150 of the bytes.
TINY = LLAMA_3B | dict(hidden_size=64, intermediate_size=64)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
READ_CHUNK = 16 << 20
START_TIMEOUT_S = 900.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28, help="decoder layers of the big checkpoint (Llama-3.2-3B: 28)")
    p.add_argument("--runs", type=int, default=3, help="rounds; each times every configuration once")
    p.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shard-gb", type=float, default=5.0, help="largest checkpoint file (transformers' default: 5)")
    p.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (kept, and reused)")
    p.add_argument("--baseline-checkout", type=Path, default=None,
                   help="also start, each round at TP=1, the worker of this checkout (an A/B of two commits)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the whole page cache (root) instead of evicting the checkpoint's files only")
    return p.parse_args()


# ---------------------------------------------------------------- the checkpoints
def write_checkpoint(folder: Path, shape: dict[str, int], shard_bytes: int) -> None:
    """config.json, SmolLM2's tokenizer, and RandomCheckpoint's bfloat16 tensors in shards of at most
    `shard_bytes` with transformers' index (made and written one shard at a time)."""
    marker = folder / "written.json"
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    smollm2 = resolve_model("smollm2")
    config = json.loads((smollm2 / "config.json").read_text())
    config |= shape | {"dtype": "bfloat16", "vocab_size": 49152, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, folder / name)
    random = RandomCheckpoint(load_model_config(folder), torch.bfloat16, torch.device("cpu"))
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    for name in [*random, ""]:   # "": the end, which writes the last shard
        tensor = random[name] if name else None
        held = sum(t.nbytes for t in shard.values())
        if shard and (tensor is None or held + tensor.nbytes > shard_bytes):
            save_file(shard, str(folder / f"part-{len(shards)}"), metadata={"format": "pt"})
            shards.append(list(shard))
            shard = {}
        if tensor is not None:
            shard[name] = tensor
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):   # named once their number is known
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"part-{i}").rename(folder / file)
        weight_map |= dict.fromkeys(names, file)
    (folder / SHARD_INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    os.sync()
    marker.write_text(json.dumps(shape))


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint_files(folder)[0])


# ---------------------------------------------------------------- the page cache
def make_cold(folders: list[Path], drop_caches: bool) -> int:
    """Evict the folders' weight files from the page cache; the bytes of them still resident after (fincore)."""
    files = [p for folder in folders for p in checkpoint_files(folder)[0]]
    if drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    else:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return sum(resident_bytes(p) for p in files)


def resident_bytes(path: Path) -> int:
    """The file's bytes in the page cache (util-linux's fincore; 0 where it is missing)."""
    if shutil.which("fincore") is None:
        return 0
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def read_s(folder: Path, readers: int) -> float:
    """Seconds for `readers` threads to read the folder's weight files, each a contiguous 1/readers of every file
    (unbuffered reads into one buffer per thread: they release the GIL)."""
    files = checkpoint_files(folder)[0]

    def read(k: int) -> None:
        buffer = memoryview(bytearray(READ_CHUNK))
        for path in files:
            size = path.stat().st_size
            start, end = size * k // readers, size * (k + 1) // readers
            with path.open("rb", buffering=0) as f:
                f.seek(start)
                while start < end:
                    n = f.readinto(buffer[:min(READ_CHUNK, end - start)])
                    if not n:
                        break
                    start += n

    threads = [threading.Thread(target=read, args=(k,)) for k in range(readers)]
    begin = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - begin


# ---------------------------------------------------------------- the worker
@dataclass(frozen=True, slots=True)
class Start:
    ready_s: float                 # spawn to the first /health 200
    storage_bytes: dict[int, int]  # /proc/PID/io read_bytes at ready, by process (the worker, then its ranks)
    phases: list[tuple[float, str]]  # the worker's log lines that mark phases, seconds after spawn


PHASES = re.compile(r"weights of .* read|slices of .* read and placed|rank \d+: .* MB of weights|model .* KV blocks|"
                    r"engine started")


@dataclass(frozen=True, slots=True)
class Setup:
    tensor_parallel: int   # --tensor-parallel-size
    checkout: Path         # the worker's code: where it is started (python -m puts its folder first on the path)

    def label(self) -> str:
        return f"{self.tensor_parallel}" + ("" if self.checkout == ROOT else f", {self.checkout}")


def start_worker(folder: Path, setup: Setup, log_path: Path) -> Start:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--model", str(folder), "--dtype", "bfloat16",
           "--port", str(port), "--tensor-parallel-size", str(setup.tensor_parallel)]
    with log_path.open("wb") as log:
        spawned = time.time()
        begin = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=setup.checkout, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            ready_s = _wait_healthy(proc, port, begin, log_path)
            storage = {pid: _storage_read_bytes(pid) for pid in [proc.pid, *_descendants(proc.pid)]}
        finally:
            stop(proc)
    return Start(ready_s, storage, _phases(log_path.read_text(errors="replace"), spawned))


def _wait_healthy(proc: subprocess.Popen, port: int, begin: float, log_path: Path) -> float:
    while time.perf_counter() - begin < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise SystemExit(f"worker exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return time.perf_counter() - begin
        except OSError:
            pass
        time.sleep(0.02)
    raise SystemExit(f"worker not ready in {START_TIMEOUT_S:.0f} s; log {log_path}")


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = (task / "children").read_text().split() if (task / "children").is_file() else []
        for child in map(int, children):
            found += [child, *_descendants(child)]
    return found


def _storage_read_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/io").read_text()
    return int(re.search(r"^read_bytes: (\d+)", text, re.M).group(1))  # type: ignore[union-attr]


def _phases(log: str, spawned: float) -> list[tuple[float, str]]:
    """(seconds after spawn, message) of the log lines PHASES names (asctime's local time, to the millisecond)."""
    out = []
    for line in log.splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ (.*)", line)
        if m and PHASES.search(m.group(3)):
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            out.append((at - spawned, m.group(3)))
    return out


# ---------------------------------------------------------------- the run
def main() -> None:
    args = parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="cold-start-"))
    big, tiny = work / f"llama-3b-shape-{args.layers}-layers", work / "llama-tiny"
    try:
        began = time.perf_counter()
        write_checkpoint(big, LLAMA_3B | {"num_hidden_layers": args.layers}, int(args.shard_gb * 1e9))
        write_checkpoint(tiny, TINY, int(args.shard_gb * 1e9))
        print(f"checkpoints ready in {time.perf_counter() - began:.0f} s: {weight_bytes(big) / 1e9:.2f} GB in "
              f"{len(checkpoint_files(big)[0])} files, tiny {weight_bytes(tiny) / 1e6:.1f} MB", flush=True)
        rows = run_rounds(args, big, tiny, work)
        report(args, big, rows)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def run_rounds(args: argparse.Namespace, big: Path, tiny: Path, work: Path) -> dict[Setup, dict[str, list]]:
    """Per setup: each round's read s, fixed and ready Starts, and resident bytes left after each eviction."""
    setups = [Setup(tp, ROOT) for tp in args.tensor_parallel_sizes]
    setups += [Setup(1, args.baseline_checkout.resolve())] if args.baseline_checkout else []
    rows: dict[Setup, dict[str, list]] = {s: {"read": [], "fixed": [], "ready": [], "resident": []} for s in setups}
    for k, setup in enumerate(setups):
        start_worker(tiny, setup, work / f"warm-up-setup{k}.log")
    for round_ in range(args.runs):
        for k, (setup, row) in enumerate(rows.items()):
            tp, logs = setup.tensor_parallel, f"setup{k}-round{round_ + 1}.log"
            row["resident"].append(make_cold([big, tiny], args.drop_caches))
            row["read"].append(read_s(big, tp))
            row["resident"].append(make_cold([big, tiny], args.drop_caches))
            row["fixed"].append(start_worker(tiny, setup, work / f"tiny-{logs}"))
            row["resident"].append(make_cold([big, tiny], args.drop_caches))
            row["ready"].append(start_worker(big, setup, work / f"big-{logs}"))
            print(f"round {round_ + 1}, TP={setup.label()}: read {row['read'][-1]:.2f} s, "
                  f"fixed {row['fixed'][-1].ready_s:.2f} s, ready {row['ready'][-1].ready_s:.2f} s "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
    return rows


def report(args: argparse.Namespace, big: Path, rows: dict[Setup, dict[str, list]]) -> None:
    size = weight_bytes(big)
    cold = "dropped the page cache (drop_caches)" if args.drop_caches else "evicted the files (POSIX_FADV_DONTNEED)"
    left = max(max(row["resident"]) for row in rows.values())
    print(f"\n{machine()}\n{args.layers} layers of Llama-3.2-3B's shape, bfloat16, {size / 1e9:.2f} GB; before each "
          f"read and start: {cold}; at most {left / 1e6:.1f} MB of them still resident (fincore): "
          f"{'cold' if left < size // 100 else 'NOT cold'}; median of {args.runs} rounds\n")
    print("| TP | read s (GB/s) | ready s | fixed s | (ready - fixed) / read | target | runs: read / ready / fixed |")
    print("|---|---|---|---|---|---|---|")
    for setup, row in rows.items():
        read = statistics.median(row["read"])
        ready = statistics.median(s.ready_s for s in row["ready"])
        fixed = statistics.median(s.ready_s for s in row["fixed"])
        runs = " / ".join(" ".join(f"{x:.2f}" for x in xs) for xs in
                          (row["read"], [s.ready_s for s in row["ready"]], [s.ready_s for s in row["fixed"]]))
        ratio = (ready - fixed) / read
        print(f"| {setup.label()} | {read:.2f} ({size / read / 1e9:.2f}) | {ready:.2f} | {fixed:.2f} | "
              f"**{ratio:.2f}** | <= {TARGET} {'met' if ratio <= TARGET else 'NOT met'} | {runs} |")
    for setup, row in rows.items():
        tp = setup.label()
        median = sorted(row["ready"], key=lambda s: s.ready_s)[len(row["ready"]) // 2]
        fetched = ", ".join(f"{b / 1e9:.2f}" for b in median.storage_bytes.values())
        print(f"\nTP={tp}, the median start: GB fetched from storage by each process (the worker, then its children: "
              f"the ranks and multiprocessing's resource tracker): {fetched}")
        for at, message in median.phases:
            print(f"  {at:6.2f} s  {message[:150]}")
        fixed = sorted(row["fixed"], key=lambda s: s.ready_s)[len(row["fixed"]) // 2]
        print(f"TP={tp}, the median tiny start's phases:")
        for at, message in fixed.phases:
            print(f"  {at:6.2f} s  {message[:150]}")


if __name__ == "__main__":
    main()
