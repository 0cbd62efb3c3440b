"""flash_attn on CUDA (fp16/bf16): `flash_attn_varlen_func` for steps with prefill, `flash_attn_with_kvcache`
for pure decode.

flash-attn 2 reads paged K/V through `block_table` only when block_size is a multiple of 256; with smaller
blocks this backend gathers each sequence's K/V into contiguous varlen tensors first (one index_select).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from backends.attention.base import AttentionBackend, AttentionBackendName, StepLayout

PAGED_BLOCK_MULTIPLE = 256


@dataclass(frozen=True, slots=True)
class FlashMetadata:
    cu_seqlens_q: torch.Tensor          # [num_chunks + 1] int32 cumulative query lengths
    cu_seqlens_k: torch.Tensor          # [num_chunks + 1] int32 cumulative context + query lengths
    max_seqlen_q: int                   # longest chunk
    max_seqlen_k: int                   # longest sequence
    seq_lens: torch.Tensor              # [num_chunks] int32 context + query lengths
    block_tables: torch.Tensor | None   # [num_chunks, max_blocks] int32, when paged reads are possible
    key_slots: torch.Tensor | None      # [sum seq_lens] int64 cache slot of every key, when gathering
    decode_only: bool                   # every chunk has one token


class FlashAttentionBackend(AttentionBackend[FlashMetadata]):
    name = AttentionBackendName.FLASH

    def prepare(self, layout: StepLayout) -> FlashMetadata:
        dev, bs = layout.device, self.shape.block_size
        seq_lens = layout.seq_lens
        max_blocks = max(-(-n // bs) for n in seq_lens)
        tables = [list(t[:max_blocks]) + [0] * (max_blocks - len(t[:max_blocks])) for t in layout.block_tables]
        block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        cu_k = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        cu_q = torch.nn.functional.pad(
            torch.tensor(layout.query_lens, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32), (1, 0))
        paged = bs % PAGED_BLOCK_MULTIPLE == 0
        key_slots = None
        if not paged:
            # [n, max_blocks * bs] slots, keep the first seq_len of each row, in order
            slots = (block_tables.long().unsqueeze(2) * bs + torch.arange(bs, device=dev)).view(len(seq_lens), -1)
            keep = torch.arange(slots.shape[1], device=dev).unsqueeze(0) < lens.unsqueeze(1)
            key_slots = slots[keep]
        return FlashMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(layout.query_lens),
                             max_seqlen_k=max(seq_lens), seq_lens=lens,
                             block_tables=block_tables if paged else None, key_slots=key_slots,
                             decode_only=max(layout.query_lens) == 1)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: FlashMetadata) -> torch.Tensor:
        scale = self.shape.scale
        if metadata.block_tables is not None and metadata.decode_only:
            out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.seq_lens,
                                          block_table=metadata.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        if metadata.block_tables is not None:
            k, v = k_cache, v_cache
        else:
            assert metadata.key_slots is not None   # prepare gathers whenever it cannot page
            flat = (-1, *k_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
            k = k_cache.view(flat).index_select(0, metadata.key_slots)
            v = v_cache.view(flat).index_select(0, metadata.key_slots)
        return flash_attn_varlen_func(q, k, v, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                                      metadata.max_seqlen_q, metadata.max_seqlen_k, softmax_scale=scale,
                                      causal=True, block_table=metadata.block_tables)
