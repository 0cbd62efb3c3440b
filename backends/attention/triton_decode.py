"""CUDA attention without flash_attn: a Triton paged-decode kernel for one-token chunks, SDPA for prefill chunks.

The kernel runs one program per (sequence, KV head): it walks the sequence's block table one block at a
time with an online softmax, for all query heads of that KV head at once (GQA-aware: K/V read once).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backends.attention.base import AttentionBackend, AttentionBackendName, DecodeRows, StepLayout, decode_rows
from backends.attention.sdpa import PaddedGroup, attend_group, padded_group


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, BLOCK_SIZE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [GROUP_PAD, DIM_PAD]
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    for b in range(0, num_blocks):
        block = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
        t_ok = b * BLOCK_SIZE + t < seq_len
        kv_offsets = block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, DIM_PAD]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [n, num_heads, head_dim] (one token per sequence) over each sequence's paged K/V."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_size & (block_size - 1):
        raise ValueError("the Triton decode kernel needs a power-of-two block_size")
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view of qkv
    _paged_decode_kernel[(n, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 2), HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size)
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
            return paged_decode(q, k_cache, v_cache, decode.block_tables, decode.seq_lens, self.shape.scale)
        out = q.new_empty(q.shape)
        if decode is not None:
            rows = paged_decode(q.index_select(0, decode.token_index), k_cache, v_cache,
                                decode.block_tables, decode.seq_lens, self.shape.scale)
            out.index_copy_(0, decode.token_index, rows)
        assert group is not None   # not decode-only: some chunk is a prefill
        rows = attend_group(self.shape, q, k_cache, v_cache, group, gather_queries=True)
        if group.real_rows is not None:
            rows = rows.index_select(0, group.real_rows)
        out.index_copy_(0, group.out_tokens, rows)
        return out
