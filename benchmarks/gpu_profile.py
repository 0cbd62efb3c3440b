"""Where a decode step's GPU time goes (not a test; needs CUDA): one sequence's decode steps through the model
runner, eagerly under torch's profiler, kernels summed by name; beside it the same step replayed from a CUDA
graph, timed with CUDA events. The kernels' sum is the GPU's busy time; the replay's time over it is what
launch gaps and idle time add.

    python benchmarks/gpu_profile.py [--models smollm2-shape,llama8b] [--variants torch,fused+split]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backends.worker.batch import ForwardBatch, SeqChunk  # noqa: E402
from backends.worker.model_runner import ModelRunner  # noqa: E402
from benchmarks.gpu_bench import cuda_time, model_folder, use_variant  # noqa: E402

STEPS = 20


def profile(name: str, variant: str, work: Path, context: int, top: int) -> None:
    use_variant(variant)
    folder, random = model_folder(name, work)
    runner = ModelRunner(folder, dtype=torch.bfloat16, device="cuda", num_blocks=256, cuda_graph_max_batch=8,
                         random_weights=random)
    table = tuple(range(-(-(context + 1) // runner.block_size)))
    batch = ForwardBatch((SeqChunk((5,), context, table),))
    graphs = runner.decode_graphs
    replay_s = cuda_time(lambda: runner.execute(batch), 50)
    runner.decode_graphs = None
    eager_s = cuda_time(lambda: runner.execute(batch), 20)
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            runner.execute(batch)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]   # the kernels (and copies)
    busy_us = sum(e.self_device_time_total for e in rows) / STEPS
    launches = sum(e.count for e in rows) / STEPS
    print(f"\n## {name}, kernels: {variant}, one sequence at context {context}")
    print(f"replayed step {replay_s * 1e3:.3f} ms, eager step {eager_s * 1e3:.3f} ms; kernels per step {launches:.0f}, "
          f"their GPU time {busy_us / 1e3:.3f} ms (replay / busy {replay_s * 1e6 / busy_us:.2f})")
    print("| kernel | per step | us per step | share |\n|---|---|---|---|")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:top]:
        per_step = e.self_device_time_total / STEPS
        print(f"| {e.key[:90]} | {e.count / STEPS:.0f} | {per_step:.1f} | {per_step / busy_us:.1%} |")
    runner.decode_graphs = graphs
    del runner, graphs
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-shape,llama8b")
    p.add_argument("--variants", default="torch,fused+split")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="switchyard-gpu-profile-"))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            profile(name, variant, work, args.context, args.top)


if __name__ == "__main__":
    main()
