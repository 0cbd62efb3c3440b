"""The CUDA family without Triton: torch's fused RMSNorm, full-width rotary tables (three kernels per rotary
instead of seven), and the residual add inside the projection's matrix product. A decode step there is
hundreds of tiny kernels at about 3 us each (docs/gpu.md), so each kernel saved counts.

The registry hands out the Triton family (triton.py) instead when Triton is installed and SWITCHYARD_CUDA_FUSED
is not 0 (registry.select_cuda).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.models.kernels.base import LayerKernels, apply_rotary_full, rotary_tables


class CudaKernels(LayerKernels):
    name = "cuda"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # one fused kernel (statistics in float32) instead of eight small ones
        return F.rms_norm(x, weight.shape, weight, eps)

    def rotary_tables(self, inv_freq: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-width cos|cos and -sin|sin, [num_tokens, 1, head_dim], that apply_rotary_full reads."""
        cos, sin = rotary_tables(inv_freq, positions, dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary_full(x, cos, sin)

    def linear_add(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool,
                   residual: torch.Tensor) -> torch.Tensor:
        """One addmm: the add rides in the matrix product's epilogue."""
        return torch.addmm(residual, x, weight if transposed else weight.t())
