"""The grouped expert products of a mixture-of-experts layer as Triton kernels on CUDA: the (token, expert) slots
sorted by expert, then one product per active expert over its rows, as backends/models/moe.py's grouped_experts
computes them with torch, but with nothing read back to the host (so a CUDA graph captures it as it is).

Two launches over tiles of sorted rows, each tile inside one expert's rows:
- gate_up with SiLU(gate)·up in its epilogue, the token rows gathered from x: h [T*k, I] in sorted order;
- down, each row times its routing weight (float32), written to its slot: [T*k, H] float32, summed per token.
Which tile belongs to which expert is found on the device from the per-expert counts (`expert_tiles`). Tiles
past the last expert's rows exit at once, so the grid is sized by the batch's shape, not by its routing.

Imported only where Triton is installed, through backends/models/kernels/triton.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backends.attention.triton_mla import dot_precision

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _expert_product_kernel(
    a_ptr, w_ptr, out_ptr, a_rows_ptr, out_rows_ptr, scale_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    n_cols, k_dim, stride_am, stride_we, stride_wn, stride_om,
    GATED: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:   # past the last expert's rows
        return
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    r_ok = rows < tl.load(tile_end_ptr + tile)
    a_rows = tl.load(a_rows_ptr + rows, mask=r_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < n_cols
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)   # GATED: the up rows, n_cols below the gate's
    for start in range(0, k_dim, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < k_dim
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)   # [BLOCK_M, BLOCK_K]; see triton_mla.dot_precision
        w_at = w_base + cols[None, :].to(tl.int64) * stride_wn + k[:, None]   # [BLOCK_K, BLOCK_N]: W^T's tile
        w_mask = k_ok[:, None] & c_ok[None, :]
        acc += tl.dot(a, tl.load(w_at, mask=w_mask, other=0.0).to(tl.float32), input_precision=PRECISION)
        if GATED:
            up = tl.load(w_at + n_cols * stride_wn, mask=w_mask, other=0.0).to(tl.float32)
            acc_up += tl.dot(a, up, input_precision=PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_rows = tl.load(out_rows_ptr + rows, mask=r_ok, other=0).to(tl.int64)
    if SCALED:
        acc = acc * tl.load(scale_ptr + out_rows, mask=r_ok, other=0.0)[:, None]
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """The sorted slots cut into tiles of one expert's rows each, all on the device."""
    order: torch.Tensor    # [T*k] int64: slot (t * k + j) of each sorted row, grouped by expert
    expert: torch.Tensor   # [max_tiles] int32: the tile's expert, -1 past the last one
    start: torch.Tensor    # [max_tiles] int32: the tile's first sorted row
    end: torch.Tensor      # [max_tiles] int32: one past the last row of the tile's expert


def block_m(num_slots: int, num_experts: int) -> int:
    """Rows per tile: 16 for decode-sized batches (a few rows an expert), 64 where experts get many."""
    return 16 if num_slots <= 16 * num_experts else 64


def expert_tiles(topk_ids: torch.Tensor, num_experts: int, rows_per_tile: int) -> ExpertTiles:
    """The tiles of `topk_ids` [T, k]: at most cdiv(T*k, rows_per_tile) + min(E, T*k) of them, a bound that
    depends only on the shape; counted with scatter_add, which reads nothing back (bincount would)."""
    flat = topk_ids.reshape(-1)
    slots = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    firsts = torch.cumsum(counts, 0) - counts             # [E] each expert's first sorted row
    tiles = (counts + rows_per_tile - 1) // rows_per_tile
    tile_ends = torch.cumsum(tiles, 0)                    # [E] one past each expert's last tile
    max_tiles = triton.cdiv(slots, rows_per_tile) + min(num_experts, slots)
    index = torch.arange(max_tiles, device=flat.device)
    expert = torch.searchsorted(tile_ends, index, right=True)   # E past the last tile
    valid = expert < num_experts
    known = expert.clamp(max=num_experts - 1)
    start = firsts[known] + (index - (tile_ends[known] - tiles[known])) * rows_per_tile
    end = firsts[known] + counts[known]
    return ExpertTiles(order=order, expert=torch.where(valid, expert, -1).to(torch.int32),
                       start=start.to(torch.int32), end=end.to(torch.int32))


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, a_rows: torch.Tensor, out_rows: torch.Tensor,
            scale: torch.Tensor | None, tiles: ExpertTiles, n_cols: int, rows_per_tile: int) -> None:
    gated = scale is None
    grid = (tiles.expert.shape[0], triton.cdiv(n_cols, BLOCK_N))
    _expert_product_kernel[grid](
        a, w, out, a_rows, out_rows, out if scale is None else scale, tiles.expert, tiles.start, tiles.end,
        n_cols, a.shape[1], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATED=gated, SCALED=not gated, BLOCK_M=rows_per_tile, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION=dot_precision(a.dtype))


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """sum_j w[t, j] * down[e] (silu_mul(gate_up[e] x[t])) with e = topk_ids[t, j]: x [T, H] in, [T, H] out in
    x's dtype. gate_up [E, 2I, H] and down [E, H, I] stored [out, in] (moe.MoEBlock's stacked layout)."""
    num_tokens, k = topk_ids.shape
    num_experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("grouped_experts needs contiguous rows of x and of the experts' weights")
    if num_tokens == 0:
        return torch.empty_like(x)
    rows_per_tile = block_m(num_tokens * k, num_experts)
    tiles = expert_tiles(topk_ids, num_experts, rows_per_tile)
    sorted_rows = torch.arange(num_tokens * k, device=x.device)
    h = torch.empty((num_tokens * k, width), dtype=x.dtype, device=x.device)   # [T*k, I] in sorted order
    _launch(x, gate_up, h, tiles.order // k, sorted_rows, None, tiles, width, rows_per_tile)
    per_slot = torch.empty((num_tokens * k, x.shape[1]), dtype=torch.float32, device=x.device)
    _launch(h, down, per_slot, sorted_rows, tiles.order, topk_weights.float().reshape(-1), tiles, x.shape[1],
            rows_per_tile)
    return per_slot.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)
