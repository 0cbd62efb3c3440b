"""The ops the decoder layers need from a device family, chosen once when a model is built (`select_kernels`),
and their reference: `LayerKernels` computes each op with plain torch ops, as transformers spells them out
(RMSNorm in float32, half-width rotary tables, projections through F.linear or a matmul over the stored
layout), and runs on any device that has no family of its own.

Each family is one file with a subclass that overrides what it does faster; layers hold the chosen kernels
and call them without asking which device they run on. A family still checks what varies per call (dtype,
contiguity, rank) and falls back to the reference for inputs its fused path does not take, so it never
changes a result, only how it is computed.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

# A Triton one-row projection: (rows per program, columns per loop step, warps); triton_ops.GEMV_CONFIGS
GemvConfig = tuple[int, int, int]


class ModuleTree(Protocol):
    """What `prepare` walks: a model's modules (an nn.Module, or a CausalLM)."""

    def modules(self) -> Iterator[nn.Module]: ...


class GemvLinear(Protocol):
    """A projection that can take a one-row kernel (layers.Linear), seen by its shape only: the layers import
    these kernels, not the other way round."""
    weight: torch.Tensor
    gemv_config: GemvConfig | None

    def gemv_eligible(self) -> bool: ...


def gemv_projections(model: ModuleTree) -> list[GemvLinear]:
    """The projections of `model` that a one-row kernel can take now (a plain [out, in] weight). Found by the
    method, not by isinstance against GemvLinear: from Python 3.12 a runtime protocol check reads attributes
    statically, and an nn.Module's weight (a registered parameter) is then not found."""
    found: list[GemvLinear] = []
    for module in model.modules():
        eligible = getattr(module, "gemv_eligible", None)
        if callable(eligible) and eligible():
            found.append(cast(GemvLinear, module))
    return found


class LayerKernels:
    """RMSNorm, SiLU·mul, rotary and projection kernels: the reference, which the device families subclass."""

    name = "torch"
    # True: RMSNorm.add_norm adds the residual inside the norm's kernel, so the decoder carries the residual
    # from layer to layer (LlamaDecoderLayer.forward_fused) instead of adding it inside the projections.
    residual_in_norm: bool = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of x, scaled by `weight`."""
        # Spelled out as the reference does (in float32): on CPU this beats F.rms_norm's decomposition.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x). The sum may be written
        over x, which the caller must own (a sublayer's fresh output)."""
        total = x if residual is None else x + residual
        return self.rms_norm(total, weight, eps), total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up [num_tokens, 2 * width], the gate half first (a fused gate_up projection)."""
        width = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :width]) * gate_up[..., width:]

    def rotary_tables(self, inv_freq: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `positions` in the layout `rotate` (and `rotary_store`) read, built once per step."""
        return rotary_tables(inv_freq, positions, dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on x [num_tokens, heads, head_dim] with this family's tables."""
        return apply_rotary(x, cos, sin)

    def rotary_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """The rotated q [num_tokens, heads, head_dim] out of qkv, with the rotated k and the v written into the
        caches in the same kernel; None where this family has no such kernel (then q, k and v go to the
        attention backend, which writes the cache)."""
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) for a plain [out, in] weight, one this family did not pack."""
        return F.linear(x, weight, bias)

    def linear_add(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool,
                   residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T for a plain bias-less weight, stored [in, out] when `transposed`, else [out, in]."""
        return residual + (torch.mm(x, weight) if transposed else self.linear(x, weight, None))

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
        """x [1, in] times weight [out, in] transposed, by the one-row kernel `config` names (`prepare` picks
        them); the reference is the matrix product it replaces."""
        return torch.nn.functional.linear(x, weight)

    skips_foreign_experts = False   # whether expert_products takes ids past the last expert (adding nothing)

    def combine_experts(self, out: torch.Tensor, order: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor | None:
        """grouped_experts' weighted sum [T, H] over each token's k rows of out [T * k, H] (in expert order:
        order[p] is row p's slot) by this family's own kernel; None where it has none (then torch ops)."""
        return None

    def expert_products(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
        """A sparse MLP's routed output [T, H] for x [T, H] and its experts' stacked weights (gate_up [E, 2I, H],
        down [E, H, I]) by this family's own grouped kernel; None where it has none (then
        backends.models.moe.grouped_experts runs them with torch ops)."""
        return None

    def pack(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """`weight` [out, in] in `dtype`, in the layout `packed_linear` reads; None: this family keeps plain
        layouts for it."""
        return None

    def pack_wide(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """A float32 copy of a `dtype` weight, packed for `packed_linear`, that steps of at least `wide_rows` rows
        multiply instead (where this family's float32 products outrun its `dtype` ones on many rows); None: the
        `pack` copy serves every step."""
        return None

    wide_rows = 0   # rows from which a Linear with a pack_wide copy multiplies in float32

    def pack_expert(self, weight: torch.Tensor) -> torch.Tensor | None:
        """One expert's [out, in] weight (backends.models.moe) in the layout `packed_linear` reads; None: this
        family runs experts from their plain stacked layout."""
        return None

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) for a weight `pack` returned."""
        raise TypeError(f"the {self.name} kernels pack no weights")

    def prepare(self, model: ModuleTree) -> None:
        """Once the weights are in (before any CUDA graph captures): per-shape choices measured on the device.
        The reference measures nothing."""
        return None


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
