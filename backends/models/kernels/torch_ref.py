"""The reference kernels: plain torch ops, for devices without a family of their own (and the base of those).

The values every other family is held to: RMSNorm in float32 as the reference spells it out, half-width
rotary tables, and projections through F.linear or matmuls over the stored layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.models.kernels.base import LayerKernels
from backends.models.kernels.rotary import apply_rotary, rotary_tables


class TorchKernels(LayerKernels):
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Spelled out as the reference does (in float32): on CPU this beats F.rms_norm's decomposition.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = x if residual is None else x + residual
        return self.rms_norm(total, weight, eps), total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        width = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :width]) * gate_up[..., width:]

    def rotary_tables(self, inv_freq: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim // 2] each (layers.rotary_tables)."""
        return rotary_tables(inv_freq, positions, dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin)

    def linear_add(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool,
                   residual: torch.Tensor) -> torch.Tensor:
        return residual + (torch.mm(x, weight) if transposed else F.linear(x, weight))
