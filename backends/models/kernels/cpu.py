"""The CPU family: RMSNorm (with the residual add before it), SiLU·mul and rotary as one C++ pass each
(backends/cpu_kernels/fused_layers.cpp), and float32 projections through oneDNN with the weight packed once at load.

Fused ops: instead of 3-8 ATen kernels each: on the 2-core EPYC that made a one-sequence decode step 0.82x as
long, 32 sequences 0.89x and a 270-token prefill 0.92x (docs/benchmarks.md, "Fused CPU layer ops"). bf16 rounds
where the ATen path rounds, so both give the same values. SWITCHYARD_CPU_FUSED_LAYERS=0 turns them off (read
once, see cpu_fused_layers); inputs they do not take run the reference ops.

Packing (`torch.ops.mkldnn._reorder_linear_weight`) replaces the plain copy. Measured on the 2-core EPYC, the
30 layers of SmolLM2 (425 MB): at 2-8 rows (decode batches) 1.5-2.6x faster than MKL's sgemm in any layout,
the LM head at 2-32 rows 2-3x; a whole one-sequence decode step is as fast on 2 threads and ~1.35x slower on 1
(docs/benchmarks.md, "oneDNN-packed matmuls"). Rows are not guaranteed bit-identical across batch sizes: they
were on the AVX2 EPYC, not on an AVX-512 one, so nothing may rely on it (tests compare within float32
rounding, tests/backends/numerics.py).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from backends import cpu_kernels
from backends.models.kernels.base import LayerKernels

log = logging.getLogger(__name__)

FUSED_SWITCH = "SWITCHYARD_CPU_FUSED_LAYERS"
WIDE_SWITCH = "SWITCHYARD_CPU_WIDE_PREFILL"
_FUSED_DTYPES = (torch.float32, torch.bfloat16)
_PACK_ROWS_HINT = 32   # the batch size oneDNN is told to pack for (4 and 32 measured alike at 1-8 rows)


@functools.cache
def cpu_fused_layers() -> bool:
    """Whether the fused CPU layer kernels are on: built (backends.cpu_kernels) and not switched off."""
    if os.environ.get(FUSED_SWITCH, "1") == "0":
        log.info("fused CPU layers off (%s=0): RMSNorm, SiLU·mul and rotary run on ATen ops", FUSED_SWITCH)
        return False
    return cpu_kernels.load()


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16's vdpbf16ps, or AMX tiles): there oneDNN's
    bf16 products read half the bytes of float32 at full speed; elsewhere (AVX2) bf16 is converted in software."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def own_experts(dtype: torch.dtype) -> bool:
    """Whether a sparse MLP's experts in `dtype` stay in plain rows for the grouped C++ expert kernel: float32 and
    bfloat16, with the fused kernels on. On the 2-core EPYC (AVX2), a 64-expert, top-6 layer (hidden 2048) ran at
    1-32 tokens 1.55-1.78x as fast as one oneDNN-packed product per expert in float32 (0.91x at 1,024 tokens, a
    long prefill chunk), and in bf16 1.7-5.4x as fast as ATen's products (docs/benchmarks.md, "Grouped CPU expert
    kernel"). Where the CPU has native bf16, bf16 steps of more than NATIVE_BF16_EXPERT_TOKENS tokens go to ATen's
    products over the same plain rows instead (expert_products)."""
    return dtype in (torch.float32, torch.bfloat16) and cpu_fused_layers()


# Where the CPU multiplies bf16 natively, the kernel's vdpbf16ps dot products win on the few rows a decode step gives
# each expert, and AMX's tiles behind ATen's products win on prefill chunks. On the 2-core AMX Xeon, one such layer,
# kernel against ATen over plain experts: 1.33x at 1 token, 1.32x at 8, 1.30x at 32, 1.12x at 48, 0.95x at 64,
# 0.45x at 256 (docs/benchmarks.md, "MoE on an AMX CPU").
NATIVE_BF16_EXPERT_TOKENS = 48


def fusable(x: torch.Tensor) -> bool:
    """Whether the fused CPU kernels take x: a supported dtype whose last dimension is contiguous, with no
    gradient to track (the kernels have no backward), and the kernels on."""
    return (x.dtype in _FUSED_DTYPES and x.stride(-1) == 1
            and not (x.requires_grad and torch.is_grad_enabled()) and cpu_fused_layers())


class CpuKernels(LayerKernels):
    name = "cpu"

    def __init__(self) -> None:
        cpu_fused_layers()   # builds the C++ kernels now, when the model is built, not in the first request

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and weight.dtype == x.dtype and fusable(x):
            return torch.ops.switchyard_cpu.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    # The decoder layers hand each residual add to the norm after it (LlamaDecoderLayer.forward_fused): with the
    # kernels built, one C++ pass (add_rms_norm) where ATen's add and the rms_norm kernel took two.
    residual_in_norm = True

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if (residual is not None and x.dim() == 2 and x.is_contiguous() and residual.shape == x.shape
                and residual.dtype == weight.dtype == x.dtype and residual.stride(-1) == 1 and fusable(x)
                and x.data_ptr() != residual.data_ptr()):
            return torch.ops.switchyard_cpu.add_rms_norm(x, residual, weight, eps), x
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and fusable(gate_up):
            return torch.ops.switchyard_cpu.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and cos.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous() and fusable(x):
            return torch.ops.switchyard_cpu.rotary(x, cos, sin)
        return super().rotate(x, cos, sin)

    def rotary_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """The C++ rotary_store (fused_layers.cpp) where it applies: one pass for the rotary on q and k and both
        cache writes, in place of rotate, two slices and two index_copy_ calls; None (ATen's path) elsewhere."""
        full_tables = cos.numel() * 2 * (heads + 2 * kv_heads) == qkv.numel()   # no partial rotary
        if not (qkv.dim() == 2 and k_cache.dim() == 4 and cos.dtype == qkv.dtype == k_cache.dtype == v_cache.dtype
                and full_tables and cos.is_contiguous() and sin.is_contiguous() and k_cache.stride(-1) == 1
                and v_cache.stride(-1) == 1 and fusable(qkv)):
            return None
        return torch.ops.switchyard_cpu.rotary_store(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slot_mapping)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """bf16 on a CPU without native bf16 (which `pack` leaves plain) through the C++ rows_linear: on the
        2-core EPYC (AVX2) 1.4-1.9x as fast as ATen's bf16 product at 1 row, 3.4-3.7x at 8 and 5.3-8.2x at 32-256
        (a 2048- and a 6144-row projection and a 32,000-row head of hidden 2048; docs/benchmarks.md, "Grouped CPU
        expert kernel and bf16 products on AVX2")."""
        if (x.dtype == torch.bfloat16 and weight.dtype == x.dtype and x.dim() == 2 and weight.dim() == 2
                and weight.is_contiguous() and (bias is None or bias.dtype == x.dtype) and not native_bf16()
                and fusable(x)):
            return torch.ops.switchyard_cpu.rows_linear(x.contiguous(), weight,
                                                        None if bias is None else bias.contiguous())
        return super().linear(x, weight, bias)

    def pack(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """float32 weights in oneDNN's blocked layout, and bfloat16 ones where the CPU multiplies bfloat16 natively
        (native_bf16); other dtypes keep plain layouts."""
        if not torch.backends.mkldnn.is_available():
            return None
        if dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16()):
            return torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), _PACK_ROWS_HINT)
        return None

    # Measured on the 2-core Xeon (AVX512-BF16, no AMX), SmolLM2's 30 layers, oneDNN-packed: bfloat16 against
    # float32 was 0.56x as long at 1 row, 0.92x at 16, 1.02x at 32, 1.36x at 48 and 1.99x at 256 (prefill chunks).
    wide_rows = 48

    def pack_wide(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Where the CPU has AVX512-BF16 but no AMX, bfloat16 products stop paying once a step has wide_rows rows:
        vdpbf16ps does twice an FMA's work at half its rate, so compute-bound products run no faster than in
        float32 and lose to oneDNN's float32 kernels by up to 2x; a float32 copy then serves prefill chunks (a
        third more weight memory than float32 alone). SWITCHYARD_CPU_WIDE_PREFILL=0 turns it off."""
        if (dtype != torch.bfloat16 or not native_bf16() or torch.cpu._is_amx_tile_supported()
                or os.environ.get(WIDE_SWITCH, "1") == "0" or not torch.backends.mkldnn.is_available()):
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous(), _PACK_ROWS_HINT)

    def pack_expert(self, weight: torch.Tensor) -> torch.Tensor | None:
        """None (plain [out, in] rows) where the grouped C++ kernel runs the experts (own_experts); elsewhere
        experts as `pack` packs projections, in their own dtype."""
        return None if own_experts(weight.dtype) else self.pack(weight, weight.dtype)

    skips_foreign_experts = True   # moe_experts: an id past the last expert adds nothing

    def expert_products(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
        """The routed experts in one C++ call (backends/cpu_kernels/moe_experts.cpp) where own_experts; each
        active expert's weights are read once, over all of its tokens."""
        if not (own_experts(x.dtype) and x.dim() == 2 and gate_up.dim() == 3 and gate_up.dtype == x.dtype
                and gate_up.is_contiguous() and down.is_contiguous() and gate_up.shape[0] > 0):
            return None
        if x.dtype == torch.bfloat16 and native_bf16() and x.shape[0] > NATIVE_BF16_EXPERT_TOKENS:
            return None   # grouped_experts: ATen's bf16 products over the same plain rows
        return torch.ops.switchyard_cpu.moe_experts(x.contiguous(), topk_ids.contiguous(),
                                                    topk_weights.float().contiguous(), gate_up, down)

    def combine_experts(self, out: torch.Tensor, order: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor | None:
        """One C++ pass (moe_experts.cpp's moe_combine), float32 sums, in place of un-permuting out, widening it
        and a batched product."""
        if not (out.dim() == 2 and out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous()
                and cpu_fused_layers()):
            return None
        return torch.ops.switchyard_cpu.moe_combine(out, order.contiguous(), topk_weights.float().contiguous())

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
