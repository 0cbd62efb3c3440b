"""Decode attention per layer on the CPU: the paged kernel reading blocks in place against gather + SDPA.

SmolLM2-135M's shape (9 query heads over 3 KV heads, head_dim 64, blocks of 16 tokens, 30 layers), n sequences
of ~384 tokens (256 prompt + 128 out) on shuffled blocks. Each repetition runs both paths over all 30 layers'
caches, as a decode step does (a layer's K/V is not in cache when its turn comes), the two alternating so that
load from other processes falls on both; the table gives medians of ms per layer and new / old. With
--query-len Q each sequence has Q new tokens, as a speculative verify of K = Q - 1 drafts has.

    .venv/bin/python benchmarks/cpu_decode_attention.py [--threads 2] [--reps 15] [--dtype float32] [--query-len 1]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from backends.attention.base import AttentionShape, StepLayout, decode_rows
from backends.attention.cpu_paged import PagedDecode, load_paged_decode
from backends.attention.sdpa import attend_group, padded_group

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
PROMPT, OUT = 256, 128


def make_step(n: int, q_len: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[StepLayout, list[torch.Tensor],
                                                                           list[torch.Tensor], torch.Tensor]:
    """A step of n sequences with contexts spread over 256..383 tokens and q_len new tokens each (1: decodes; more:
    speculative tokens to verify), and per-layer K/V caches."""
    contexts = [PROMPT + int(x) for x in torch.randint(0, OUT, (n,), generator=gen)]
    blocks = [-(-(c + q_len) // BLOCK) for c in contexts]
    num_blocks = sum(blocks) + 8
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for count in blocks:
        tables.append(tuple(order[used:used + count]))
        used += count
    layout = StepLayout(query_lens=(q_len,) * n, context_lens=tuple(contexts), block_tables=tuple(tables),
                        slot_mapping=torch.zeros(n * q_len, dtype=torch.long), device=torch.device("cpu"))
    cache_shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_caches = [torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(LAYERS)]
    v_caches = [torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(LAYERS)]
    # q is a strided view of a fused qkv row, as the model hands it over
    qkv = torch.randn(n * q_len, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return layout, k_caches, v_caches, qkv[:, :HEADS]


def time_layers(fn: Callable[[int], torch.Tensor]) -> float:
    """ms per layer of one pass over all layers."""
    start = time.perf_counter()
    for layer in range(LAYERS):
        fn(layer)
    return 1e3 * (time.perf_counter() - start) / LAYERS


def bench(kernel: PagedDecode, shape: AttentionShape, layout: StepLayout, k_caches: list[torch.Tensor],
          v_caches: list[torch.Tensor], q: torch.Tensor, reps: int) -> tuple[float, float]:
    """Median ms per layer of gather + SDPA and of the kernel, over `reps` alternating passes."""
    n = len(layout.query_lens)
    with torch.inference_mode():
        group = padded_group(shape, layout, range(n), layout.starts)   # what SDPABackend.prepare built before
        rows = decode_rows(layout, range(n), layout.starts, BLOCK)     # what it builds with the kernel

        def old(layer: int) -> torch.Tensor:
            return attend_group(shape, q, k_caches[layer], v_caches[layer], group, gather_queries=False)

        def new(layer: int) -> torch.Tensor:
            return kernel(q, k_caches[layer], v_caches[layer], rows.block_tables, rows.seq_lens, rows.query_starts,
                          shape.scale)

        torch.testing.assert_close(new(0).float(), old(0).float(), atol=2e-2, rtol=2e-2)
        olds, news = [], []
        for _ in range(reps + 1):   # the first pass warms up and is dropped
            olds.append(time_layers(old))
            news.append(time_layers(new))
    return statistics.median(olds[1:]), statistics.median(news[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--query-len", type=int, default=1, help="new tokens per sequence (6: a verify of K = 5)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernel = load_paged_decode()
    if kernel is None:
        raise SystemExit("the CPU paged decode kernel is unavailable (see the log above)")
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5, dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"{args.dtype}, {args.query_len} new tokens per sequence; ms per layer, median of {args.reps} interleaved "
          f"passes over {LAYERS} layers")
    print("| seqs | mean keys | gather + SDPA (old) | paged kernel (new) | new / old |")
    print("|---|---|---|---|---|")
    for n in (1, 8, 32):
        layout, k_caches, v_caches, q = make_step(n, args.query_len, dtype, gen)
        old, new = bench(kernel, shape, layout, k_caches, v_caches, q, args.reps)
        print(f"| {n} | {statistics.mean(layout.seq_lens):.0f} | {old:.3f} | {new:.3f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
