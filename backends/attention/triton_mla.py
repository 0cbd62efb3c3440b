"""Latent-attention (MLA, DeepSeek-V3) decode on CUDA: a Triton paged kernel over the compressed latent cache.

Each token's cache entry is one vector [c_kv, k_pe] split over the K and V caches (its first half in K, its second
in V: backends/models/deepseek_v3.py). It is every query head's key, and its first `value_dim` channels are every
head's value, so the kernel reads each latent block once for a block of query heads: scores are q·[K half, V half]
and the output is p·[K half, V half] cut to `value_dim` channels. The queries arrive absorbed (through W_UK), so
nothing per head is ever expanded. Splits across programs merge as the dense kernel's do (triton_splits.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.attention.triton_splits import MAX_SPLITS, merge_splits_kernel, programs_wanted

HEAD_BLOCK = 16   # query heads per program: tl.dot needs at least 16 rows


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's precision for operands of `dtype`, widened to float32 in the kernels: TF32 holds every bfloat16
    and float16 value exactly, so their products are the 16-bit products (a 16-bit tl.dot is wrong under Triton
    3.9's interpreter, which `make test` runs); float32 stays IEEE."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["splits"])
def _latent_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr, block_tables_ptr, seq_lens_ptr, scale, splits,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_vb, stride_vt, stride_bt, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    VALUE_DIM: tl.constexpr, OUT_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, splits), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    h = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    d = tl.arange(0, HALF_PAD)
    t = tl.arange(0, TILE)
    h_ok = h < NUM_HEADS
    d_ok = d < HALF
    q_at = q_ptr + seq * stride_qt + h[:, None] * stride_qh + d[None, :]
    q_mask = h_ok[:, None] & d_ok[None, :]
    q_k = tl.load(q_at, mask=q_mask, other=0.0).to(tl.float32)          # meets the K half
    q_v = tl.load(q_at + HALF, mask=q_mask, other=0.0).to(tl.float32)   # meets the V half
    m_i = tl.full([HEADS_PER_PROGRAM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS_PER_PROGRAM], dtype=tl.float32)
    acc_k = tl.zeros([HEADS_PER_PROGRAM, HALF_PAD], dtype=tl.float32)   # value channels 0..HALF
    acc_v = tl.zeros([HEADS_PER_PROGRAM, HALF_PAD], dtype=tl.float32)   # value channels HALF..VALUE_DIM
    for tile in range(start, end, TILE):
        token = tile + t
        t_ok = token < end
        block = tl.load(block_tables_ptr + seq * stride_bt + token // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        offset = token % BLOCK_SIZE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + (block * stride_kb + offset * stride_kt)[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)   # [TILE, HALF_PAD]
        v = tl.load(v_cache_ptr + (block * stride_vb + offset * stride_vt)[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        scores = (tl.dot(q_k, tl.trans(k), input_precision=PRECISION)
                  + tl.dot(q_v, tl.trans(v), input_precision=PRECISION)) * scale   # [HEADS, TILE]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc_k = acc_k * alpha[:, None] + tl.dot(p, k, input_precision=PRECISION)
        acc_v = acc_v * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    k_out = h_ok[:, None] & (d_ok & (d < VALUE_DIM))[None, :]
    v_out = h_ok[:, None] & (d_ok & (d + HALF < VALUE_DIM))[None, :]
    if not SPLIT:
        out_at = out_ptr + seq * stride_ot + h[:, None] * stride_oh + d[None, :]
        tl.store(out_at, (acc_k / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=k_out)
        tl.store(out_at + HALF, (acc_v / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=v_out)
    else:
        # the layout merge_splits_kernel reads: partials [n, NUM_HEADS, splits, OUT_PAD], stats (max, sum)
        row = (seq * NUM_HEADS + h) * splits + split   # [HEADS_PER_PROGRAM]
        tl.store(part_ptr + row[:, None] * OUT_PAD + d[None, :], acc_k, mask=k_out)
        tl.store(part_ptr + row[:, None] * OUT_PAD + HALF + d[None, :], acc_v, mask=v_out)
        tl.store(stats_ptr + row * 2, m_i, mask=h_ok)
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=h_ok)


def latent_tile(half: int) -> int:
    """Latent tokens per loop step: a [tile, half] slice of each cache stays within 32 KB of float32."""
    return max(16, min(64, 8192 // triton.next_power_of_2(half)))


def latent_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, value_dim: int, splits: int | None = None) -> torch.Tensor:
    """Latent attention of q [n, num_heads, 2 * half] (one token per sequence, absorbed queries) over each
    sequence's paged latent, k_cache and v_cache [num_blocks, block_size, 1, half]: [n, num_heads, value_dim].
    `splits`: programs per (sequence, head block), by default as many as fill the device."""
    n, num_heads, query_dim = q.shape
    _, block_size, _, half = k_cache.shape
    if query_dim != 2 * half or not 0 < value_dim <= 2 * half or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("latent_decode takes queries of both cached halves and contiguous latent caches")
    head_blocks = triton.cdiv(num_heads, HEAD_BLOCK)
    if splits is None:   # enough programs for the device, as triton_decode.decode_splits
        splits = max(1, min(MAX_SPLITS, programs_wanted(q.device) // (n * head_blocks)))
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}]")
    out_pad = triton.next_power_of_2(value_dim)
    out = torch.empty((n, num_heads, value_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    part = stats = out   # unused with one split
    if splits > 1:
        part = torch.empty((n, num_heads, splits, out_pad), dtype=torch.float32, device=q.device)
        stats = torch.empty((n, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    half_pad = triton.next_power_of_2(max(half, 16))
    _latent_decode_kernel[(n, head_blocks, splits)](
        q, k_cache, v_cache, out, part, stats, block_tables, seq_lens, scale, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEADS_PER_PROGRAM=HEAD_BLOCK, HALF=half, HALF_PAD=half_pad, VALUE_DIM=value_dim,
        OUT_PAD=out_pad, BLOCK_SIZE=block_size, TILE=latent_tile(half), SPLIT=splits > 1,
        PRECISION=dot_precision(k_cache.dtype), num_warps=8 if half_pad >= 256 else 4)
    if splits > 1:
        merge_splits_kernel[(n, num_heads)](
            part, stats, out, splits, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=value_dim,
            DIM_PAD=out_pad, SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS))
    return out
