"""Torch SDPA over the paged cache: the CPU path and the reference every other backend is tested against.

Chunks are split into groups, decodes (one new token) of similar lengths and prefills; each group
gathers its sequences' blocks into one padded [n, kv_heads, L, head_dim] tensor and runs one SDPA call
with an additive mask, so the per-layer Python work does not grow with the number of sequences.
On the CPU, decodes and short chunks (speculative tokens to verify) instead go to one call of the paged kernel
(cpu_paged.py), which reads the blocks in place, when it is built and switched on; without it they take the
gather path above.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.attention.base import (
    AttentionBackend,
    AttentionBackendName,
    AttentionShape,
    DecodeRows,
    StepLayout,
    decode_rows,
)
from backends.attention.cpu_paged import PagedDecode, load_paged_decode, max_chunk

_MAX_PADDING = 1.5       # a decode group's padded blocks may be this many times its real blocks ...
_MIN_WASTE_BLOCKS = 16   # ... or exceed them by this many (a separate SDPA call costs more than that)


@dataclass(frozen=True, slots=True)
class PaddedGroup:
    """Chunks attended together, padded to `max_query_len` queries and `max_blocks` blocks each."""
    num_seqs: int                  # chunks in the group
    max_query_len: int             # padded query rows per chunk
    max_blocks: int                # padded blocks per chunk (keys = max_blocks * block_size)
    query_index: torch.Tensor      # [num_seqs * max_query_len] int64: step token read by each padded row
    real_rows: torch.Tensor | None  # [group tokens] int64: padded rows that are real (None: all are)
    out_tokens: torch.Tensor       # [group tokens] int64: step token index of each real row
    block_ids: torch.Tensor        # [num_seqs * max_blocks] int64: blocks to gather, pads are block 0
    mask: torch.Tensor | None      # [num_seqs, 1, max_query_len, keys] additive 0/-inf; None: plain causal
    k_buffer: torch.Tensor         # [num_seqs * max_blocks, block_size, kv_heads, head_dim], reused per layer
    v_buffer: torch.Tensor         # same shape as k_buffer


@dataclass(frozen=True, slots=True)
class PagedDecodeRows:
    """A step's decodes and short chunks for the CPU paged kernel."""
    kernel: PagedDecode   # the loaded kernel
    rows: DecodeRows      # its inputs, shared by every layer


@dataclass(frozen=True, slots=True)
class SDPAMetadata:
    groups: tuple[PaddedGroup, ...]  # decodes first (unless `paged`), then prefills; empty only if `paged` covers all
    num_tokens: int                  # tokens in the step
    identity: bool                   # one group whose real rows are exactly the step's tokens, in order
    paged: PagedDecodeRows | None    # the decodes, when the CPU paged kernel runs them


class SDPABackend(AttentionBackend[SDPAMetadata]):
    name = AttentionBackendName.SDPA

    def __init__(self, shape: AttentionShape, device: torch.device | None = None) -> None:
        super().__init__(shape, device)
        self._max_chunk = max_chunk(shape)   # the longest chunk the CPU kernel takes for this shape (0: none)
        if device is not None:
            self._paged_kernel(device)   # a worker builds or loads the CPU kernel at start, not in its first decode

    def prepare(self, layout: StepLayout) -> SDPAMetadata:
        starts = layout.starts
        shortest = min(layout.query_lens, default=self._max_chunk + 1)
        kernel = self._paged_kernel(layout.device) if shortest <= self._max_chunk else None
        paged = None
        if kernel is not None:   # decodes and short chunks (speculative verifies) to the kernel, prefills to SDPA
            short = [i for i, q in enumerate(layout.query_lens) if q <= self._max_chunk]
            prefills = [i for i, q in enumerate(layout.query_lens) if q > self._max_chunk]
            paged = PagedDecodeRows(kernel, decode_rows(layout, short, starts, self.shape.block_size))
            buckets = [prefills]
        else:
            decodes = [i for i, q in enumerate(layout.query_lens) if q == 1]
            prefills = [i for i, q in enumerate(layout.query_lens) if q > 1]
            buckets = [*self._length_buckets(layout, decodes), prefills] if decodes else [prefills]
        groups = tuple(padded_group(self.shape, layout, members, starts) for members in buckets if members)
        identity = len(groups) == 1 and paged is None and groups[0].real_rows is None and (
            len(layout.query_lens) == 1 or groups[0].max_query_len == 1)
        return SDPAMetadata(groups=groups, num_tokens=sum(layout.query_lens), identity=identity, paged=paged)

    def _paged_kernel(self, device: torch.device) -> PagedDecode | None:
        """The CPU paged-decode kernel when it applies here (CPU, a shape it handles, built, switched on)."""
        if device.type != "cpu" or self._max_chunk == 0:
            return None
        return load_paged_decode()

    def _length_buckets(self, layout: StepLayout, decodes: list[int]) -> list[list[int]]:
        """Decodes split by context length so that padding every one to its group's longest gathers and
        attends at most about half again the real keys: a 2,000-token sequence among short ones must
        not make each of them gather 2,000 tokens of K/V per layer."""
        bs = self.shape.block_size
        blocks = {i: -(-(layout.context_lens[i] + 1) // bs) for i in decodes}
        buckets: list[list[int]] = []
        real = 0
        for i in sorted(decodes, key=blocks.__getitem__):
            padded = (len(buckets[-1]) + 1) * blocks[i] if buckets else 0
            too_padded = padded > _MAX_PADDING * (real + blocks[i]) and padded - real - blocks[i] > _MIN_WASTE_BLOCKS
            if not buckets or too_padded:
                buckets.append([])
                real = 0
            buckets[-1].append(i)
            real += blocks[i]
        return [sorted(bucket) for bucket in buckets]   # step order within a group (see `identity`)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: SDPAMetadata) -> torch.Tensor:
        paged = metadata.paged
        if paged is not None and paged.rows.in_order:
            return self._attend_paged(q, k_cache, v_cache, paged)
        if metadata.identity:
            return attend_group(self.shape, q, k_cache, v_cache, metadata.groups[0], gather_queries=False)
        out = q.new_empty((*q.shape[:2], self.shape.out_dim))
        if paged is not None:
            rows = self._attend_paged(q.index_select(0, paged.rows.token_index), k_cache, v_cache, paged)
            out.index_copy_(0, paged.rows.token_index, rows)
        for group in metadata.groups:
            rows = attend_group(self.shape, q, k_cache, v_cache, group, gather_queries=True)
            if group.real_rows is not None:
                rows = rows.index_select(0, group.real_rows)
            out.index_copy_(0, group.out_tokens, rows)
        return out

    def _attend_paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      paged: PagedDecodeRows) -> torch.Tensor:
        """[rows, num_heads, head_dim] for the paged rows' queries q [rows, num_heads, head_dim], blocks read in
        place."""
        rows = paged.rows
        return paged.kernel(q, k_cache, v_cache, rows.block_tables, rows.seq_lens, rows.query_starts, self.shape.scale)


def padded_group(shape: AttentionShape, layout: StepLayout, members: Sequence[int],
                 starts: Sequence[int]) -> PaddedGroup:
    """The step's chunks `members` (their first tokens at `starts`) padded into one group."""
    bs, dev = shape.block_size, layout.device
    n = len(members)
    q_lens = [layout.query_lens[i] for i in members]
    ctx = [layout.context_lens[i] for i in members]
    max_q = max(q_lens)
    blocks_needed = [-(-(c + q) // bs) for c, q in zip(ctx, q_lens, strict=True)]
    max_blocks = max(blocks_needed)
    query_index: list[int] = []
    real_rows: list[int] = []
    out_tokens: list[int] = []
    block_ids: list[int] = []
    for row, (i, q_len, nb) in enumerate(zip(members, q_lens, blocks_needed, strict=True)):
        start = starts[i]
        query_index += [start + min(j, q_len - 1) for j in range(max_q)]
        real_rows += range(row * max_q, row * max_q + q_len)
        out_tokens += range(start, start + q_len)
        block_ids += list(layout.block_tables[i][:nb]) + [0] * (max_blocks - nb)
    plain_prompt = n == 1 and ctx[0] == 0 and max_q > 1
    mask = None if plain_prompt else _causal_mask(ctx, max_q, max_blocks * bs, shape.dtype, dev)
    buf_shape = (n * max_blocks, bs, shape.num_kv_heads, shape.head_dim)
    all_real = len(real_rows) == n * max_q
    as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    return PaddedGroup(
        num_seqs=n, max_query_len=max_q, max_blocks=max_blocks,
        query_index=as_index(query_index), real_rows=None if all_real else as_index(real_rows),
        out_tokens=as_index(out_tokens), block_ids=as_index(block_ids), mask=mask,
        k_buffer=torch.empty(buf_shape, dtype=shape.dtype, device=dev),
        v_buffer=torch.empty(buf_shape, dtype=shape.dtype, device=dev))


def _causal_mask(ctx: list[int], max_q: int, num_keys: int, dtype: torch.dtype,
                 dev: torch.device) -> torch.Tensor:
    """Query j of a chunk sits at position ctx + j and sees keys 0..ctx + j (its own new K/V included)."""
    keys = torch.arange(num_keys, device=dev).view(1, 1, -1)
    last_key = torch.tensor(ctx, device=dev).view(-1, 1, 1) + torch.arange(max_q, device=dev).view(1, -1, 1)
    mask = torch.zeros((len(ctx), max_q, num_keys), dtype=dtype, device=dev)
    return mask.masked_fill_(keys > last_key, float("-inf")).unsqueeze(1)  # [n, 1, max_q, keys]


def attend_group(shape: AttentionShape, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 group: PaddedGroup, gather_queries: bool) -> torch.Tensor:
    """[num_seqs * max_query_len, num_heads, out_dim] for the group's padded query rows."""
    n, max_q = group.num_seqs, group.max_query_len
    kv_heads, heads = shape.num_kv_heads, shape.num_heads
    if gather_queries:
        q = q.index_select(0, group.query_index)
    k_buf = torch.index_select(k_cache, 0, group.block_ids, out=group.k_buffer)
    v_buf = torch.index_select(v_cache, 0, group.block_ids, out=group.v_buffer)
    k, v = _keys_values(shape, k_buf, v_buf, n, group.max_blocks * shape.block_size)
    if max_q == 1:
        # Decode: the heads sharing a KV head become that head's query rows, [n, kv_heads, g, query_dim],
        # so K/V are read once per KV head and the mask [n, 1, 1, keys] broadcasts.
        q = q.reshape(n, kv_heads, heads // kv_heads, shape.query_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=shape.scale)
        return out.reshape(n, heads, shape.out_dim)
    q = q.reshape(n, max_q, heads, shape.query_dim).transpose(1, 2)  # [n, heads, max_q, query_dim]
    # One prompt without context needs no mask: top-left causal is exact, padded keys come last.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, is_causal=group.mask is None,
                                         scale=shape.scale, enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).reshape(n * max_q, heads, shape.out_dim)


def _keys_values(shape: AttentionShape, k_buf: torch.Tensor, v_buf: torch.Tensor, n: int,
                 keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K [n, kv_heads, keys, query_dim] and V [n, kv_heads, keys, out_dim] of gathered blocks; for latent
    attention both read the one vector whose halves the K and V caches hold (V its first channels)."""
    kv_heads, head_dim = shape.num_kv_heads, shape.head_dim
    if shape.latent_value_dim is None:
        k = k_buf.view(n, keys, kv_heads, head_dim).transpose(1, 2)
        return k, v_buf.view(n, keys, kv_heads, head_dim).transpose(1, 2)
    latent = torch.cat((k_buf, v_buf), dim=-1).view(n, 1, keys, 2 * head_dim)   # [n, 1, keys, query_dim]
    return latent, latent[..., :shape.latent_value_dim]
