"""The model runner with the fused CPU layer kernels (RMSNorm, SiLU·mul, rotary) against ATen's ops, in one run.

One ModelRunner on SmolLM2; each round times a prefill and decode steps of 1, 8 and 32 sequences with the
kernels off and on (SWITCHYARD_CPU_FUSED_LAYERS read again for each), the order flipping each round so that
load from other processes falls on both. The table gives medians over the rounds of wall ms per step, with
process CPU ms beside them, and new / old.

    .venv/bin/python benchmarks/cpu_fused_layers.py [--dtype float32] [--rounds 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
from datetime import UTC, datetime

import torch

from backends.models.kernels import cpu
from backends.worker.loader import resolve_model
from backends.worker.model_runner import ModelRunner
from tools.bench_runner import bench_decode, bench_prefill


def set_fused(on: bool) -> None:
    os.environ[cpu.FUSED_SWITCH] = "1" if on else "0"
    cpu.cpu_fused_layers.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=270)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(resolve_model("smollm2"), dtype=getattr(torch, args.dtype), device="cpu", num_blocks=None)
    set_fused(True)
    assert cpu.cpu_fused_layers(), "the CPU kernels did not build"
    cases = [f"prefill {args.prefill_tokens} tokens", *(f"decode step, {b} seqs" for b in args.batches)]
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            set_fused(on)
            times.setdefault((cases[0], on), []).append(bench_prefill(runner, args.prefill_tokens, 5))
            for case, b in zip(cases[1:], args.batches, strict=True):
                times.setdefault((case, on), []).append(bench_decode(runner, b, args.context, 12))
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC | {platform.processor() or platform.machine()} | "
          f"torch {torch.__version__} | {torch.backends.cpu.get_cpu_capability()} | {args.threads} threads | "
          f"{args.dtype} | context {args.context} | medians of {args.rounds} rounds")
    print("| step | ATen ops, ms wall (CPU) | fused, ms wall (CPU) | fused / ATen, wall | CPU |")
    print("|---|---|---|---|---|")
    for case in cases:
        old, new = times[(case, False)], times[(case, True)]
        old_wall, new_wall = statistics.median(w for w, _ in old), statistics.median(w for w, _ in new)
        old_cpu, new_cpu = statistics.median(c for _, c in old), statistics.median(c for _, c in new)
        print(f"| {case} | {old_wall * 1e3:.1f} ({old_cpu * 1e3:.1f}) | {new_wall * 1e3:.1f} ({new_cpu * 1e3:.1f}) "
              f"| {new_wall / old_wall:.3f} | {new_cpu / old_cpu:.3f} |")


if __name__ == "__main__":
    main()
