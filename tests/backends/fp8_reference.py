"""Block-scaled FP8 as the tests make and read it, written independently of backends/worker/fp8_blocks.py:
every scale expanded to the matrix's full shape, then one elementwise product."""
from __future__ import annotations

import torch

E4M3_MAX = 448.0   # torch.finfo(torch.float8_e4m3fn).max


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] float32: each element's block scale (edge blocks cut to the matrix)."""
    rows, cols = shape
    return scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [rows, cols], float32 scale_inv [row blocks, column blocks]): each block's absmax / 448,
    as DeepSeek's and transformers' quantizers scale them (an all-zero block gets 1)."""
    rows, cols = weight.shape
    num_row_blocks, num_col_blocks = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(num_row_blocks * block[0], num_col_blocks * block[1])
    padded[:rows, :cols] = weight
    absmax = padded.view(num_row_blocks, block[0], num_col_blocks, block[1]).abs().amax(dim=(1, 3))
    scale_inv = torch.where(absmax > 0, absmax / E4M3_MAX, torch.ones_like(absmax))
    scaled = weight.float() / expand_scales(scale_inv, (rows, cols), block)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale_inv


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [rows, cols]: each stored value times its block's scale."""
    return weight.float() * expand_scales(scale_inv, tuple(weight.shape), block)
