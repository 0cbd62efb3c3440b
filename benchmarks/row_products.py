"""The CPU's small products (backends/cpu_kernels/row_dots.h) against the library paths they replace, in one run.

Two tables, medians of `--repeats` calls each:
- experts: one MoE layer's routed experts (hidden 2048, 64 experts, top-6, 1408 wide, random routing) at 1-1,024
  tokens, by `moe_experts` against backends.models.moe.grouped_experts over oneDNN-packed experts (the CPU
  kernels' path before, float32) and over plain experts (ATen's products: bf16's path before where the CPU has no
  native bf16);
- dense: a plain bf16 projection by `rows_linear` against ATen's F.linear, at 1-256 rows, for a 2048 x 2048 and a
  6144 x 2048 projection and a 32,000 x 2048 head; and in float32 against the oneDNN-packed product.
GB/s is the weight bytes read over the time. A script, not a test:

    .venv/bin/python benchmarks/row_products.py [--tokens 1 8 32 256 1024] [--rows 1 8 32 256]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends import cpu_kernels
from backends.models.kernels.registry import select_kernels
from backends.models.moe import PackedExperts, grouped_experts, softmax_topk

HIDDEN, WIDTH, EXPERTS, TOP_K = 2048, 1408, 64, 6


def median_s(repeats: int, fn: Callable[..., object], *args: object) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cell(seconds: float, gigabytes: float) -> str:
    """ms (weights GB/s), or '-' for a path that did not run."""
    return f"{seconds * 1e3:9.2f} ({gigabytes / seconds:5.1f})" if seconds == seconds else f"{'-':>17}"


def experts_table(tokens: list[int], repeats: int) -> None:
    kernels = select_kernels("cpu")
    g = torch.Generator().manual_seed(0)
    print(f"\nexperts: one layer, hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K} x {WIDTH}; ms (weights GB/s)")
    print(f"{'dtype':>9} {'tokens':>6} {'active':>6} {'moe_experts':>18} {'oneDNN packed':>18} {'ATen plain':>18}"
          f" {'vs packed':>9} {'vs plain':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=g) * HIDDEN ** -0.5).to(dtype)
        down = (torch.randn(EXPERTS, HIDDEN, WIDTH, generator=g) * WIDTH ** -0.5).to(dtype)
        packs = [(kernels.pack(gate_up[e], dtype), kernels.pack(down[e], dtype)) for e in range(EXPERTS)]
        packed = (PackedExperts(tuple(p for p, _ in packs), tuple(p for _, p in packs))
                  if all(p is not None for p, _ in packs) else None)
        for n in tokens:
            x = torch.randn(n, HIDDEN, generator=g).to(dtype)
            weights, ids = softmax_topk(torch.randn(n, EXPERTS, generator=g), TOP_K, renormalize=True)
            active = len(ids.unique())
            gigabytes = active * 3 * WIDTH * HIDDEN * gate_up.element_size() / 1e9
            ours = median_s(repeats, torch.ops.switchyard_cpu.moe_experts, x, ids, weights, gate_up, down)
            plain = median_s(repeats, grouped_experts, x, ids, weights, gate_up, down, kernels)
            onednn = (median_s(repeats, grouped_experts, x, ids, weights, gate_up[:0], down[:0], kernels, packed)
                      if packed is not None else float("nan"))
            ours_s, onednn_s, plain_s = (cell(t, gigabytes) for t in (ours, onednn, plain))
            print(f"{str(dtype).removeprefix('torch.'):>9} {n:6d} {active:6d} {ours_s:>18} {onednn_s:>18}"
                  f" {plain_s:>18} {f'{onednn / ours:.2f}x' if onednn == onednn else '-':>9}"
                  f" {plain / ours:8.2f}x")


def dense_table(rows: list[int], repeats: int) -> None:
    g = torch.Generator().manual_seed(1)
    print("\ndense: x W^T; ms (weights GB/s); baseline: bf16 ATen's F.linear, float32 oneDNN's packed product")
    print(f"{'dtype':>9} {'weight':>11} {'rows':>5} {'rows_linear':>18} {'baseline':>18} {'ours faster':>11}")
    for dtype in (torch.bfloat16, torch.float32):
        for out, width in ((2048, 2048), (6144, 2048), (32000, 2048)):
            weight = (torch.randn(out, width, generator=g) * width ** -0.5).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32) if dtype == torch.float32 else None
            gigabytes = weight.numel() * weight.element_size() / 1e9
            for n in rows:
                x = torch.randn(n, width, generator=g).to(dtype)
                ours = median_s(repeats, torch.ops.switchyard_cpu.rows_linear, x, weight, None)
                if packed is None:
                    base = median_s(repeats, torch.nn.functional.linear, x, weight)
                else:
                    base = median_s(repeats, torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
                print(f"{str(dtype).removeprefix('torch.'):>9} {f'{out}x{width}':>11} {n:5d}"
                      f" {ours * 1e3:9.2f} ({gigabytes / ours:5.1f}) {base * 1e3:9.2f} ({gigabytes / base:5.1f})"
                      f" {base / ours:10.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256, 1024])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("the CPU kernels did not build")
    experts_table(args.tokens, args.repeats)
    dense_table(args.rows, args.repeats)
    flags = torch.backends.cpu.get_cpu_capability()
    print(f"\nmachine: {platform.processor() or platform.machine()}, torch capability {flags}, {os.cpu_count()} cores,"
          f" torch threads {torch.get_num_threads()}, native bf16 {torch.cpu._is_avx512_bf16_supported()},"
          f" load average {', '.join(f'{v:.2f}' for v in os.getloadavg())}; torch {torch.__version__};"
          f" {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")


if __name__ == "__main__":
    main()
