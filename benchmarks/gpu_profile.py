"""Where a decode step's GPU time goes (not a test; needs CUDA): one sequence's decode steps through the model
runner, eagerly under torch's profiler, kernels summed by name; beside it the same step replayed from a CUDA
graph, timed with CUDA events. The kernels' sum is the GPU's busy time; the replay's time over it is what
launch gaps and idle time add.

    python benchmarks/gpu_profile.py [--models smollm2-shape,llama8b] [--variants torch,fused+split]
        [--decode-configs]   # the decode attention kernel's time by tile and warps
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backends.core.batch import ForwardBatch, SeqChunk  # noqa: E402
from backends.worker.model_runner import ModelRunner  # noqa: E402
from benchmarks.gpu_bench import cuda_time, model_folder, use_variant  # noqa: E402

STEPS = 20


def profile(name: str, variant: str, work: Path, context: int, top: int) -> None:
    use_variant(variant)
    folder, random = model_folder(name, work)
    runner = ModelRunner(folder, dtype=torch.bfloat16, device="cuda", num_blocks=256, cuda_graph_max_batch=8,
                         random_weights=random)
    from backends.models.layers import Linear

    picked = {tuple(m.weight.shape): m.gemv_config for m in runner.model.modules()
              if isinstance(m, Linear) and m.gemv_eligible()}
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
    print("one-row projections: " + ", ".join(f"[{s[0]}, {s[1]}] {'cuBLAS' if c is None else f'gemv {c}'}"
                                              for s, c in picked.items()))
    print("| kernel | per step | us per step | share |\n|---|---|---|---|")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:top]:
        per_step = e.self_device_time_total / STEPS
        print(f"| {e.key[:90]} | {e.count / STEPS:.0f} | {per_step:.1f} | {per_step / busy_us:.1%} |")
    runner.decode_graphs = graphs


def decode_configs(contexts: tuple[int, ...]) -> None:
    """The split paged-decode kernel's time by tile and warps (backends/attention/triton_decode.py), at each
    batch size a decode step meets, beside its default configuration and the unsplit kernel."""
    from backends.attention import triton_decode
    from backends.models.kernels.triton_ops import graph_seconds

    print("\n## paged decode attention, bf16, block size 16: microseconds per call (CUDA graph of 20 calls)")
    print("| heads (q/kv x dim) | n | context | unsplit | default (splits, tile) | best (tile, warps) |\n"
          "|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
        for n in (1, 8, 64):
            for context in contexts:
                per_seq = -(-context // 16)
                k_cache = torch.randn(n * per_seq, 16, kv_heads, dim, device="cuda", dtype=torch.bfloat16,
                                      generator=gen)
                v_cache = torch.randn_like(k_cache)
                q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                tables = torch.randperm(n * per_seq, device="cuda", generator=gen).view(n, per_seq).int()
                lens = torch.full((n,), context, device="cuda", dtype=torch.int32)

                call = functools.partial(functools.partial, triton_decode.paged_decode, q, k_cache, v_cache,
                                         tables, lens, dim ** -0.5)   # call(**kw): a timed call with kw
                unsplit = graph_seconds(call(splits=1))
                default = graph_seconds(call())
                splits = triton_decode.decode_splits(n, kv_heads, q.device)
                tile = triton_decode.decode_tile(heads // kv_heads, dim)
                tried = {(t, w): graph_seconds(call(tile=t, num_warps=w))
                         for t in (16, 32, 64) for w in (1, 2, 4, 8)}
                best = min(tried, key=tried.__getitem__)
                print(f"| {heads}/{kv_heads} x {dim} | {n} | {context} | {unsplit * 1e6:.1f} | {default * 1e6:.1f} "
                      f"({splits}, {tile}) | {tried[best] * 1e6:.1f} {best} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-shape,llama8b")
    p.add_argument("--variants", default="torch,fused+split")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--decode-configs", action="store_true", help="time the decode kernel's tiles and warps")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("backends.models.kernels.triton_ops").setLevel(logging.INFO)   # which kernel each shape got
    work = Path(tempfile.mkdtemp(prefix="switchyard-gpu-profile-"))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.decode_configs:
        decode_configs((256, 2048))
    for name in filter(None, args.models.split(",")):
        for variant in args.variants.split(","):
            profile(name, variant, work, args.context, args.top)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
