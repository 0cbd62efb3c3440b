"""What the model fingerprint (backends/worker/fingerprint.py) adds to a worker's start when it has a KV tier on
disk or in a shared store: the model runner built with and without it, alternately, in this process.

    .venv/bin/python benchmarks/fingerprint_cost.py [--model smollm2] [--repeat 5]

One untimed round of each comes first (the file is then in the page cache, the CPU kernels built). Prints the
medians, their difference and the ratio.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from backends.worker.loader import resolve_model
from backends.worker.model_runner import ModelRunner


def build_seconds(folder: Path, fingerprint: bool) -> float:
    start = time.perf_counter()
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=16, fingerprint_weights=fingerprint)
    seconds = time.perf_counter() - start
    assert (runner.weights_fingerprint is not None) == fingerprint
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a model spec as the worker takes it")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    folder = resolve_model(args.model)
    nbytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    build_seconds(folder, False)   # untimed: the page cache filled, the CPU kernels built
    build_seconds(folder, True)
    without, with_ = [], []
    for _ in range(args.repeat):
        without.append(build_seconds(folder, False))
        with_.append(build_seconds(folder, True))
    base, fingerprinted = statistics.median(without), statistics.median(with_)
    print(f"{folder.name}: {nbytes / 1e6:.0f} MB of safetensors; {platform.machine()}, "
          f"{torch.get_num_threads()} torch threads; medians of {args.repeat}, alternating")
    print(f"{'model runner built':<40}{'seconds':>10}")
    print(f"{'without the fingerprint (the baseline)':<40}{base:>10.3f}")
    print(f"{'with it':<40}{fingerprinted:>10.3f}")
    print(f"added: {fingerprinted - base:.3f} s ({fingerprinted / base:.2f}x the baseline)")


if __name__ == "__main__":
    main()
