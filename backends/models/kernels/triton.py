"""The CUDA family with switchyard's Triton kernels (backends/models/kernels/triton_ops.py): rotary, cache writes and
q's copy in one kernel, SiLU·mul in one, the residual add inside the next RMSNorm, and a one-row projection
where it beats cuBLAS for a weight's shape (measured in `prepare`), and a mixture of experts' grouped products
(backends/models/kernels/triton_moe.py). Imported only where Triton is installed.
"""
from __future__ import annotations

import torch

from backends.models.kernels import triton_moe, triton_ops
from backends.models.kernels.base import GemvConfig, ModuleTree
from backends.models.kernels.cuda import CudaKernels


class TritonKernels(CudaKernels):
    name = "triton"
    residual_in_norm = True

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_ops.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2:
            return triton_ops.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def rotary_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        return triton_ops.rotary_store(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slot_mapping)

    def expert_products(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
        """The grouped expert kernels (triton_moe.py) for 2-D x over stacked, contiguous experts."""
        if x.dim() != 2 or gate_up.dim() != 3 or not (x.is_contiguous() and gate_up.is_contiguous()
                                                       and down.is_contiguous()):
            return None
        return triton_moe.grouped_experts(x, topk_ids, topk_weights, gate_up, down)

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
        return triton_ops.gemv(x, weight, config)

    def prepare(self, model: ModuleTree) -> None:
        """Each plain projection's one-row kernel, before the graphs capture which one it runs."""
        triton_ops.tune_linears(model)
