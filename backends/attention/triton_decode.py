"""CUDA attention without flash_attn: a Triton paged-decode kernel for one-token chunks, SDPA for prefill chunks.
A latent cache (multi-head latent attention) decodes through its own kernel, triton_mla.py.

The kernel runs one program per (sequence, KV head, split): each split walks its share of the sequence's
tokens, a tile at a time (each token's block looked up in the block table), with an online softmax, for
all query heads of that KV head at once (GQA-aware: K/V read once). With more than one split, a second
kernel merges the splits' partial softmaxes (flash-decoding): at batch 1 a model has only a few KV heads,
and one program each would leave most of a GPU's multiprocessors idle while they walk the context in
series. The split count depends only on the batch's shape, so a CUDA graph captures it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backends.attention.base import AttentionBackend, AttentionBackendName, DecodeRows, StepLayout, decode_rows
from backends.attention.sdpa import PaddedGroup, attend_group, padded_group
from backends.attention.triton_mla import latent_decode
from backends.attention.triton_splits import MAX_SPLITS, merge_splits_kernel, programs_wanted

SPLIT = True   # False: one program per (sequence, KV head), as before the splits (a benchmark's baseline)


# `splits` is a run-time value, not specialised on: a new split count must not compile a new kernel in a step
@triton.jit(do_not_specialize=["splits"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr, block_tables_ptr, seq_lens_ptr, scale, splits,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, splits), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, TILE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [GROUP_PAD, DIM_PAD]
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for tile in range(start, end, TILE):
        token = tile + t
        t_ok = token < end
        block = tl.load(block_tables_ptr + seq * stride_bt + token // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        kv_offsets = (block * stride_kb + (token % BLOCK_SIZE) * stride_kt)[:, None] + kv_head * stride_kh + d[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [TILE, DIM_PAD]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, TILE]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        # partials [n, NUM_HEADS, splits, DIM_PAD] and stats [n, NUM_HEADS, splits, 2] (max, sum), float32;
        # an empty split leaves max -inf and sum 0, which the merge weighs at 0
        row = (seq * NUM_HEADS + heads) * splits + split   # [GROUP_PAD]
        tl.store(part_ptr + row[:, None] * DIM_PAD + d[None, :], acc, mask=g_ok[:, None])
        tl.store(stats_ptr + row * 2, m_i, mask=g_ok)
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=g_ok)


def decode_splits(n: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) for a decode of n sequences: enough programs for the device."""
    if not SPLIT:
        return 1
    return max(1, min(MAX_SPLITS, programs_wanted(device) // (n * num_kv_heads)))


def _padded(group: int, head_dim: int) -> tuple[int, int]:
    """The kernel's block sizes for the query heads of one KV head and for the head dimension."""
    return max(triton.next_power_of_2(group), 2), triton.next_power_of_2(head_dim)


def decode_tile(group: int, head_dim: int) -> int:
    """K/V tokens per loop step: as many as keep the [group, tile, dim] products (padded) in registers."""
    group_pad, dim_pad = _padded(group, head_dim)
    return max(16, min(64, 8192 // (group_pad * dim_pad)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, splits: int | None = None, tile: int | None = None,
                 num_warps: int | None = None) -> torch.Tensor:
    """Attention of q [n, num_heads, head_dim] (one token per sequence) over each sequence's paged K/V.
    `splits`: programs per (sequence, KV head), by default decode_splits'; `tile`, `num_warps`: the kernel's
    shape, by default decode_tile's and 4 warps, or 1 where the grid fills three waves of the GPU
    (benchmarks/gpu_profile.py --decode-configs tries others)."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad, dim_pad = _padded(group, head_dim)
    splits = decode_splits(n, num_kv_heads, q.device) if splits is None else splits
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}]")
    tile = decode_tile(group, head_dim) if tile is None else tile
    if num_warps is None:
        # Triton's default of 4 warps a program, but 1 where the grid holds programs for 3 waves of the GPU: on
        # an H100, the 8B shape at 64 sequences took 69 us with 1 warp against 113 with 4, while SmolLM2's
        # (192 programs) ran faster with 4 (docs/benchmarks.md, "CUDA decode kernels")
        num_warps = 1 if 2 * n * num_kv_heads * splits >= 3 * programs_wanted(q.device) else 4
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view of qkv
    if n == 0:
        return out
    part = stats = out   # unused with one split
    if splits > 1:
        part = torch.empty((n, num_heads, splits, dim_pad), dtype=torch.float32, device=q.device)
        stats = torch.empty((n, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(n, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part, stats, block_tables, seq_lens, scale, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE=tile, SPLIT=splits > 1, num_warps=num_warps)
    if splits > 1:
        merge_splits_kernel[(n, num_heads)](
            part, stats, out, splits, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            DIM_PAD=dim_pad, SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS))
    return out


@dataclass(frozen=True, slots=True)
class TritonMetadata:
    decode: DecodeRows | None      # the one-token chunks, run by the kernel (in_order: they are the whole step)
    prefill: PaddedGroup | None    # the longer chunks, run by SDPA


class TritonDecodeBackend(AttentionBackend[TritonMetadata]):
    name = AttentionBackendName.TRITON

    def prepare(self, layout: StepLayout) -> TritonMetadata:
        starts = layout.starts
        decodes = [i for i, q in enumerate(layout.query_lens) if q == 1]
        prefills = [i for i, q in enumerate(layout.query_lens) if q > 1]
        decode = decode_rows(layout, decodes, starts, self.shape.block_size) if decodes else None
        prefill = padded_group(self.shape, layout, prefills, starts) if prefills else None
        return TritonMetadata(decode=decode, prefill=prefill)

    def static_decode_metadata(self, rows: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor) -> TritonMetadata:
        return TritonMetadata(decode=DecodeRows(token_index=rows, block_tables=block_tables, seq_lens=seq_lens,
                                                in_order=True), prefill=None)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: TritonMetadata) -> torch.Tensor:
        decode, group = metadata.decode, metadata.prefill
        if decode is not None and decode.in_order:
            return self._decode(q, k_cache, v_cache, decode)
        out = q.new_empty((*q.shape[:2], self.shape.out_dim))
        if decode is not None:
            rows = self._decode(q.index_select(0, decode.token_index), k_cache, v_cache, decode)
            out.index_copy_(0, decode.token_index, rows)
        assert group is not None   # not decode-only: some chunk is a prefill
        rows = attend_group(self.shape, q, k_cache, v_cache, group, gather_queries=True)
        if group.real_rows is not None:
            rows = rows.index_select(0, group.real_rows)
        out.index_copy_(0, group.out_tokens, rows)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                decode: DecodeRows) -> torch.Tensor:
        """The one-token rows: the latent kernel for a latent cache (triton_mla.py), else the K/V-head one."""
        if self.shape.latent_value_dim is not None:
            return latent_decode(q, k_cache, v_cache, decode.block_tables, decode.seq_lens, self.shape.scale,
                                 self.shape.latent_value_dim)
        return paged_decode(q, k_cache, v_cache, decode.block_tables, decode.seq_lens, self.shape.scale)
