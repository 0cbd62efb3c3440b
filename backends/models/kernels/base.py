"""The ops the decoder layers need from a device family, chosen once when a model is built (`select_kernels`).

Each family is one file; layers hold the chosen `LayerKernels` and call it without asking which device they
run on. A kernel still checks what varies per call (dtype, contiguity, rank) and falls back to the reference
op for inputs its fused path does not take, so a family never changes a result, only how it is computed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

# A Triton one-row projection: (rows per program, columns per loop step, warps); triton_ops.GEMV_CONFIGS
GemvConfig = tuple[int, int, int]


class ModuleTree(Protocol):
    """What `prepare` walks: a model's modules (an nn.Module, or a CausalLM)."""

    def modules(self) -> Iterator[nn.Module]: ...


class LayerKernels(ABC):
    """One device family's RMSNorm, SiLU·mul, rotary and projection kernels."""

    name: str
    # True: RMSNorm.add_norm adds the residual inside the norm's kernel, so the decoder carries the residual
    # from layer to layer (LlamaDecoderLayer.forward_fused) instead of adding it inside the projections.
    residual_in_norm: bool = False

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of x, scaled by `weight`."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x). The sum may be written
        over x, which the caller must own (a sublayer's fresh output)."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up [num_tokens, 2 * width], the gate half first (a fused gate_up projection)."""

    @abstractmethod
    def rotary_tables(self, inv_freq: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `positions` in the layout `rotate` (and `rotary_store`) read, built once per step."""

    @abstractmethod
    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on x [num_tokens, heads, head_dim] with this family's tables."""

    def rotary_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """The rotated q [num_tokens, heads, head_dim] out of qkv, with the rotated k and the v written into the
        caches in the same kernel; None where this family has no such kernel (then q, k and v go to the
        attention backend, which writes the cache)."""
        return None

    @abstractmethod
    def linear_add(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool,
                   residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T for a plain bias-less weight, stored [in, out] when `transposed`, else [out, in]."""

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
        """x [1, in] times weight [out, in] transposed, by the one-row kernel `config` names (`prepare` picks
        them); the reference is the matrix product it replaces."""
        return torch.nn.functional.linear(x, weight)

    def pack(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """`weight` [out, in] in `dtype`, in the layout `packed_linear` reads; None: this family keeps plain
        layouts for it."""
        return None

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) for a weight `pack` returned."""
        raise TypeError(f"the {self.name} kernels pack no weights")

    def prepare(self, model: ModuleTree) -> None:
        """Once the weights are in (before any CUDA graph captures): per-shape choices measured on the device.
        The reference measures nothing."""
        return None
