"""Projections with int8 weights on CPU for draft models: fbgemm's dynamic quantization (each output row of the
weight scaled to int8 once at load, the activations quantized per call), a quarter of float32's bytes.

Only proposers use it: verification checks every draft against the target, so a draft's rounding can lower
its acceptance but never changes an output token. An EAGLE head and its draft LM head read 36 MB of float32
weights a draft, which the target's 540 MB forward evicts from the cache every step; in int8 the same products
took 0.98 ms instead of 2.41 ms for one row with a cold cache on the 2-core EPYC, 1.08 against 2.06 ms for four
(docs/benchmarks.md, "EAGLE head in int8").
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from backends.models.kernels.base import ModuleTree
from backends.models.layers import Linear, LMHead, dense

# An int8 element's share of a float32 element's cost in these products, as measured with a cold cache
# (0.41-0.52 above): a quarter of the bytes, plus the per-call activation quantization. Prices drafts for the
# adaptive K (a proposer's cost_per_token).
INT8_COST = 0.5


def int8_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether int8 projections can stand in for `dtype` ones on `device`: float32 or bfloat16 on a CPU with
    fbgemm (x86 with AVX2 or better), in a torch that still has its quantized ops (it marks them deprecated)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _fbgemm_ops()


@functools.cache
def _fbgemm_ops() -> bool:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        return all(hasattr(torch.ops.quantized, op) for op in ("linear_prepack", "linear_dynamic"))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def activation_levels() -> int:
    """Steps the activations are quantized to: 256 on CPUs with AVX512-VNNI, whose int8 products accumulate in
    32 bits; 128 elsewhere, where fbgemm adds pairs of products in 16 bits, which 8-bit activations could
    saturate. 7 bits cost an EAGLE head 4% of its accepted length on spec_bench's structured prompts (1.75
    against 1.82 in float32); 8 bits none (1.83)."""
    vnni = getattr(torch.cpu, "_is_vnni_supported", None)   # private in torch 2.13: 128 levels without it
    return 256 if vnni is not None and vnni() else 128


class Int8Linear(nn.Module):
    """y = x W^T (+ bias) with W in int8, one float scale per output row; the interface of layers.Linear
    (load, forward with an optional residual). Activations are quantized per call, to activation_levels()."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.packed: torch.ScriptObject | None = None

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None, scratch: object = None) -> None:
        """Fuse HF [out, in] weights (stacked along out) and quantize them; `scratch` is not used."""
        if self.has_bias and biases is None:
            raise KeyError("checkpoint lacks a bias this layer needs")
        weight = torch.cat([dense(w).float() for w in weights], 0)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weights fuse into {list(weight.shape)}, not [{self.out_features}, {self.in_features}]")
        bias = torch.cat(biases, 0).float() if self.has_bias and biases is not None else None
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        with warnings.catch_warnings():   # torch marks its quantized tensors deprecated; 2.13's ops need them
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scale.double(), torch.zeros(self.out_features,
                                                   dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        assert self.packed is not None, "Int8Linear used before load"
        out = torch.ops.quantized.linear_dynamic(x.float(), self.packed, activation_levels() < 256).to(x.dtype)
        return out if residual is None else residual + out


def replace_linears(module: nn.Module) -> int:
    """Swap every layers.Linear under `module` for an unloaded Int8Linear of its shape (call before loading
    weights); returns how many."""
    swapped = 0
    for parent, name, child in list(_children(module)):
        if isinstance(child, Linear):
            setattr(parent, name, Int8Linear(child.in_features, child.out_features, child.bias is not None))
            swapped += 1
    return swapped


def int8_lm_head(weight: torch.Tensor) -> Int8Linear:
    """An LM head over `weight` [vocab, hidden] in int8 (no bias)."""
    head = Int8Linear(weight.shape[1], weight.shape[0], bias=False)
    head.load([weight], None)
    return head


def matmul_cost(module: ModuleTree) -> float:
    """Weight elements a forward of `module` reads through its matmuls, an int8 one at INT8_COST of a float
    one (packed or compressed layers counted by shape)."""
    total = 0.0
    for sub in module.modules():
        if isinstance(sub, Linear):
            total += sub.in_features * sub.out_features
        elif isinstance(sub, LMHead):
            total += sub.weight.numel()
        elif isinstance(sub, Int8Linear):
            total += INT8_COST * sub.in_features * sub.out_features
    return total


def _children(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    for parent in module.modules():
        for name, child in parent.named_children():
            yield parent, name, child
