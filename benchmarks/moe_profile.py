"""Where a decode step of a MoE model goes on the CPU (issue 47): the share of the grouped expert products, the
experts they read and at what rate, against what a plain 1 GiB sum reads on the same machine.

The model is moe_bench.py's checkpoint (transformers' own random Qwen3-MoE: hidden 2048, 64 experts, top-6, 1408
wide each, `--layers` layers). `--streams` sequences are
prefilled, then `--steps` decode steps of all of them are timed; each call of backends.models.moe.grouped_experts
is timed on its own. A script, not a test:

    .venv/bin/python benchmarks/moe_profile.py [--layers 2] [--streams 8] [--steps 8] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.core.batch import ForwardBatch, SeqChunk  # noqa: E402
from backends.models import moe  # noqa: E402
from backends.worker.model_runner import ModelRunner  # noqa: E402
from benchmarks.moe_bench import build_checkpoint, machine, read_bandwidth_gb_s  # noqa: E402

BLOCK = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    calls: list[tuple[float, int]] = []   # (seconds, distinct experts) per grouped_experts call
    products = moe.grouped_experts

    def timed(x: torch.Tensor, ids: torch.Tensor, *rest: object) -> torch.Tensor:
        start = time.perf_counter()
        out = products(x, ids, *rest)  # type: ignore[arg-type]
        calls.append((time.perf_counter() - start, int(ids.unique().numel())))
        return out

    moe.grouped_experts = timed   # MoEBlock.forward looks it up in the module at each call
    with tempfile.TemporaryDirectory(prefix="moe-profile-") as work:
        folder = Path(work)
        shape = argparse.Namespace(hidden=2048, layers=args.layers, experts=64, top_k=6, expert_width=1408,
                                   dtype=args.dtype)
        build_checkpoint(shape, folder)   # moe_bench's checkpoint (transformers' own init), saved; dropped here
        dtype = getattr(torch, args.dtype)
        runner = ModelRunner(folder, dtype=dtype, device="cpu", num_blocks=8 * args.streams, block_size=BLOCK)
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(10, 32000, (args.prompt_len,), generator=g).tolist() for _ in range(args.streams)]
        tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(args.streams)]
        chunks = zip(seqs, tables, strict=True)
        runner.execute(ForwardBatch(tuple(SeqChunk(tuple(s), 0, t, num_logits=1) for s, t in chunks)))
        step_s: list[float] = []
        for step in range(args.steps + 2):   # two warm-up steps
            pos = args.prompt_len + step
            batch = ForwardBatch(tuple(SeqChunk((s[-1],), pos, t) for s, t in zip(seqs, tables, strict=True)))
            calls.clear()
            start = time.perf_counter()
            runner.execute(batch)
            step_s.append(time.perf_counter() - start)
        step_s = step_s[2:]
    moe.grouped_experts = products
    expert_bytes = 3 * 2048 * 1408 * dtype.itemsize
    step = sorted(step_s)[len(step_s) // 2]
    in_experts = sum(c[0] for c in calls)   # the last step's calls
    distinct = sum(c[1] for c in calls)
    print(f"machine: {machine()}")
    print(f"{args.streams} streams, {args.layers} layers, {args.dtype}: decode step median {step * 1e3:.1f} ms "
          f"over {args.steps}; the last step's expert products {in_experts * 1e3:.1f} ms "
          f"({100 * in_experts / step_s[-1]:.0f}% of it), {distinct / args.layers:.1f} distinct experts a layer, "
          f"{distinct * expert_bytes / in_experts / 1e9:.1f} GB/s of expert weights; a 1 GiB sum reads "
          f"{read_bandwidth_gb_s():.1f} GB/s")


if __name__ == "__main__":
    main()
