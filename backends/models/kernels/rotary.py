"""Rotary position embedding as plain torch ops: the tables of one step and the rotation, half-width (the
reference, as transformers computes it) and full-width (fewer kernels, for CUDA). The kernel families call
these; `layers.rope_inv_freq` gives the frequencies.
"""
from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x [num_tokens, heads, head_dim]; cos/sin [num_tokens, 1, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_tables(inv_freq: torch.Tensor, positions: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of `positions` (float32 as the reference computes them, then `dtype`), built once per step:
    [num_tokens, 1, head_dim // 2] for apply_rotary (the kernels' rotary_tables may widen them)."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)


def apply_rotary_full(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rotary over full-width tables: three kernels per call instead of seven. On CUDA a decode step
    is hundreds of tiny kernels at about 3 us each."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos_full, torch.cat((x[..., half:], x[..., :half]), dim=-1), sin_signed)
