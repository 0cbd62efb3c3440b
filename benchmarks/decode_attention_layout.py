"""Decode attention over the paged KV cache, per layer: the cache layout we have against a head-major one.

Today's cache is [num_blocks, block_size, kv_heads, head_dim]. A decode step gathers each sequence's
blocks (one `index_select`) and hands SDPA a transposed view [n, kv_heads, keys, head_dim] whose keys
are `kv_heads * head_dim` apart. A head-major cache [kv_heads, num_blocks, block_size, head_dim] would
gather one head at a time into a buffer where each head's keys are contiguous. This script times both
(and the variants that copy instead) at SmolLM2's shape, so a layout change is decided on numbers:

    .venv/bin/python benchmarks/decode_attention_layout.py [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16     # SmolLM2-135M: 9 query heads over 3 KV heads
NUM_BLOCKS = 2000


def median_ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def layouts_row(n: int, max_blocks: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> str:
    """One table row: `n` sequences of `max_blocks` blocks each, every layout timed on the same keys and values."""
    k_heads, v_heads = k_cache.permute(2, 0, 1, 3).contiguous(), v_cache.permute(2, 0, 1, 3).contiguous()
    keys = max_blocks * BLOCK
    ids = torch.randperm(NUM_BLOCKS)[: n * max_blocks]
    q = torch.randn(n, KV_HEADS, GROUP, HEAD_DIM)
    mask = torch.zeros(n, 1, 1, keys)
    mask[..., keys - 10:] = float("-inf")
    k_buf = torch.empty(n * max_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    v_buf = torch.empty(n * max_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_dense, v_dense = torch.empty(n, KV_HEADS, keys, HEAD_DIM), torch.empty(n, KV_HEADS, keys, HEAD_DIM)
    k_hbuf = torch.empty(KV_HEADS, n * max_blocks, BLOCK, HEAD_DIM)
    v_hbuf = torch.empty(KV_HEADS, n * max_blocks, BLOCK, HEAD_DIM)

    def today() -> torch.Tensor:
        k = torch.index_select(k_cache, 0, ids, out=k_buf).view(n, keys, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = torch.index_select(v_cache, 0, ids, out=v_buf).view(n, keys, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def copied() -> torch.Tensor:
        k = torch.index_select(k_cache, 0, ids, out=k_buf).view(n, keys, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = torch.index_select(v_cache, 0, ids, out=v_buf).view(n, keys, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k_dense.copy_(k), v_dense.copy_(v), attn_mask=mask, scale=scale)

    def head_major() -> torch.Tensor:
        for h in range(KV_HEADS):
            torch.index_select(k_heads[h], 0, ids, out=k_hbuf[h])
            torch.index_select(v_heads[h], 0, ids, out=v_hbuf[h])
        k = k_hbuf.view(KV_HEADS, n, keys, HEAD_DIM).transpose(0, 1)
        v = v_hbuf.view(KV_HEADS, n, keys, HEAD_DIM).transpose(0, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    # Row r of the buffer: sequence i, head h, key j = cache row (slot(i, j) * kv_heads + h).
    slots = (ids.view(n, max_blocks, 1) * BLOCK + torch.arange(BLOCK).view(1, 1, BLOCK)).view(n, 1, keys)
    rows = (slots * KV_HEADS + torch.arange(KV_HEADS).view(1, KV_HEADS, 1)).reshape(-1)
    k_rows, v_rows = k_cache.view(-1, HEAD_DIM), v_cache.view(-1, HEAD_DIM)
    k_rbuf, v_rbuf = torch.empty(n * KV_HEADS * keys, HEAD_DIM), torch.empty(n * KV_HEADS * keys, HEAD_DIM)

    def row_gather() -> torch.Tensor:
        k = torch.index_select(k_rows, 0, rows, out=k_rbuf).view(n, KV_HEADS, keys, HEAD_DIM)
        v = torch.index_select(v_rows, 0, rows, out=v_rbuf).view(n, KV_HEADS, keys, HEAD_DIM)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    reference = today()
    for variant in (copied, head_major, row_gather):   # all compute the same attention
        torch.testing.assert_close(variant(), reference)
    a, b, c, d = median_ms(today), median_ms(copied), median_ms(head_major), median_ms(row_gather)
    return f"| {n} | {keys} | {a:.3f} | {b:.3f} | {c:.3f} | {d:.3f} | {c / a:.2f} | {d / a:.2f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scale = HEAD_DIM ** -0.5
    # The same keys and values in both layouts.
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    print(f"# torch {torch.__version__}, {args.threads} threads; ms per layer, median of 30")
    print("| seqs | keys | gather + SDPA on the transposed view (today) | gather + copy to contiguous + SDPA "
          "| head-major cache: per-head gather + SDPA | row gather + SDPA | head-major / today | row / today |")
    print("|---|---|---|---|---|---|---|---|")
    for n, max_blocks in ((1, 20), (8, 24), (32, 24)):
        print(layouts_row(n, max_blocks, k_cache, v_cache, scale))


if __name__ == "__main__":
    main()
