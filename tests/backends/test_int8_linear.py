"""Int8 projections for draft models (backends/models/int8_linear.py): each output within the error that int8
weights (per row) and 7- or 8-bit activations (per call) allow, measured against a float64 product; fusing,
biases, residuals, bfloat16 models, sums that must not saturate, and the module swap and cost count the EAGLE
proposer relies on."""
from __future__ import annotations

import pytest
import torch

from backends.models.int8_linear import (
    INT8_COST,
    Int8Linear,
    activation_levels,
    int8_available,
    matmul_cost,
    replace_linears,
)
from backends.models.kernels.registry import select_kernels
from backends.models.layers import Linear, LMHead

pytestmark = pytest.mark.skipif(not int8_available(torch.device("cpu"), torch.float32),
                                reason="this torch build has no fbgemm quantized engine")


def quantization_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|x W^T - x' W'^T| at most, per output, where W' rounds each row to 255 steps of amax/127 and x' rounds
    the whole call to activation_levels() steps over [min, max] (0 included): each product's error from both
    roundings."""
    x, weight = x.double(), weight.double()
    step_w = weight.abs().amax(dim=1) / 127                                  # [out]
    step_x = float(x.max().clamp_min(0) - x.min().clamp_max(0)) / (activation_levels() - 1)
    return (x.abs() @ torch.ones_like(weight).t() * step_w / 2 + step_x / 2 * weight.abs().sum(1)
            + weight.shape[1] * step_x * step_w / 4)


@pytest.mark.parametrize(("rows", "bias"), [(1, False), (7, True)])
def test_outputs_within_the_rounding_of_int8_weights_and_activations(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    parts = [torch.randn(96, 160, generator=g) * 0.05, torch.randn(32, 160, generator=g) * 0.2]   # fused like qkv
    biases = [torch.randn(96, generator=g), torch.randn(32, generator=g)] if bias else None
    x = torch.randn(rows, 160, generator=g) * 3
    layer = Int8Linear(160, 128, bias)
    layer.load(parts, biases)
    weight = torch.cat(parts)
    exact = x.double() @ weight.double().t() + (torch.cat(biases).double() if biases else 0)
    bound = quantization_bound(x, weight)
    err = (layer(x).double() - exact).abs()
    assert bool((err <= 1.01 * bound + 1e-5).all()), float((err - bound).max())
    assert float(err.norm() / exact.norm()) < 0.03   # 0.009-0.018 measured
    residual = torch.randn(rows, 128, generator=g)
    assert torch.allclose(layer(x, residual), residual + layer(x), atol=1e-6)


def test_a_bfloat16_model_gets_bfloat16_outputs_of_the_same_products() -> None:
    g = torch.Generator().manual_seed(3)
    layer = Int8Linear(64, 48, True)
    layer.load([torch.randn(48, 64, generator=g)], [torch.randn(48, generator=g)])
    x = torch.randn(5, 64, generator=g).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, layer(x.float()).bfloat16())


def test_the_largest_products_do_not_saturate() -> None:
    """Every activation at its top level and every weight at 127: where pairs of products were summed in 16 bits
    with 8-bit activations (255 * 127 * 2 > 32767), these outputs would come out far too small."""
    layer = Int8Linear(512, 4, False)
    layer.load([torch.ones(4, 512)], None)
    out = layer(torch.ones(2, 512))
    assert torch.allclose(out, torch.full((2, 4), 512.0), rtol=0.01)


def test_load_checks_shape_and_bias() -> None:
    with pytest.raises(ValueError, match="fuse into"):
        Int8Linear(16, 8, False).load([torch.randn(4, 16)], None)
    with pytest.raises(KeyError, match="bias"):
        Int8Linear(16, 8, True).load([torch.randn(8, 16)], None)


def test_swap_keeps_shapes_and_halves_the_cost() -> None:
    kernels = select_kernels("cpu")
    module = torch.nn.Sequential(Linear(64, 32, True, kernels), Linear(32, 16, False, kernels),
                                 LMHead(16, 100, kernels))
    before = matmul_cost(module)
    assert before == 64 * 32 + 32 * 16 + 100 * 16
    assert replace_linears(module) == 2
    first, second, head = module
    assert isinstance(first, Int8Linear) and (first.in_features, first.out_features, first.has_bias) == (64, 32, True)
    assert isinstance(second, Int8Linear) and not second.has_bias and isinstance(head, LMHead)
    assert matmul_cost(module) == INT8_COST * (64 * 32 + 32 * 16) + 100 * 16
