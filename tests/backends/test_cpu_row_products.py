"""The CPU's small products over row_dots.h: the grouped expert kernel (backends/cpu_kernels/moe_experts.cpp)
against one token and one expert at a time in float64, rows_linear (rows_linear.cpp) against F.linear in float64,
and the CPU kernels' choice of them for a sparse MLP and for a bf16 projection.

The model-level checks (our MoE models against transformers' forward and `generate`) run through it whenever it
is built, as `make test` builds it: tests/backends/models/test_moe_*.py and the MoE model tests.
"""
from __future__ import annotations

import pytest
import torch

from backends import cpu_kernels
from backends.models.kernels import cpu
from backends.models.kernels.base import LayerKernels
from backends.models.kernels.registry import select_kernels
from backends.models.layers import Linear, LMHead
from backends.models.moe import QWEN_NAMES, MoEBlock, MoEConfig, grouped_experts, softmax_topk
from tests.backends.models.test_moe_layers import naive_experts

# float32: another order of the sums moves the last bits; bf16: the products round to 8 bits, as the op-by-op
# reference's do (measured up to 1e-2 of the largest output here).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """`make test` installs a C++ compiler, so here the kernels must build and be on."""
    assert cpu_kernels.load(), "the CPU kernels did not build (see the warning logged)"
    assert cpu.cpu_fused_layers()


def case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    weights, ids = softmax_topk(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    return x, ids, weights, gate_up, down


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden, inter, experts, top_k", [
    (1, 64, 48, 8, 2),        # one decode row
    (5, 64, 48, 8, 2),        # a few rows per expert: register blocks of 1-3 (6 on AVX-512) tokens
    (100, 64, 48, 8, 2),      # many rows per expert: bf16 rows widened once per group
    (9, 50, 37, 6, 3),        # widths that are no multiple of the vector, rows no multiple of the block
    (3, 2048, 64, 4, 2),      # a row of 2048: the prefetch ahead of each bf16 row group
])
def test_moe_experts_match_a_loop_over_tokens_in_float64(dtype: torch.dtype, tokens: int, hidden: int, inter: int,
                                                         experts: int, top_k: int) -> None:
    x, ids, weights, gate_up, down = case(tokens, hidden, inter, experts, top_k, dtype, seed=tokens + hidden)
    got = torch.ops.switchyard_cpu.moe_experts(x, ids, weights, gate_up, down)
    assert got.shape == x.shape and got.dtype == dtype
    want = naive_experts(x, ids, weights, gate_up, down)
    assert relative_error(got, want) < TOLERANCE[dtype]
    # and as close to the op-by-op path (ATen products, rounded where it rounds) as that path is to float64
    reference = grouped_experts(x, ids, weights, gate_up, down, LayerKernels())
    assert relative_error(got, reference.double()) < 2 * TOLERANCE[dtype]


def test_another_ranks_experts_and_no_tokens_add_nothing() -> None:
    """Ids past the last expert held (ExpertSplit.local_ids under expert parallelism) or below 0 are skipped; a
    token whose every slot is foreign gets zeros; an empty batch gives an empty result."""
    x, ids, weights, gate_up, down = case(6, 64, 48, 4, 2, torch.float32, seed=3)
    ids = ids.clone()
    ids[0, 1] = 4            # the local count: another rank's expert
    ids[2, 0] = 11
    ids[3, :] = 4            # every slot foreign
    ids[5, 0] = -1
    got = torch.ops.switchyard_cpu.moe_experts(x, ids, weights, gate_up, down)
    assert relative_error(got, naive_experts(x, ids, weights, gate_up, down)) < TOLERANCE[torch.float32]
    assert torch.count_nonzero(got[3]) == 0 and torch.count_nonzero(got[0]) > 0
    empty = torch.ops.switchyard_cpu.moe_experts(x[:0], ids[:0], weights[:0], gate_up, down)
    assert empty.shape == (0, 64)


def test_bad_inputs_raise_instead_of_crashing() -> None:
    x, ids, weights, gate_up, down = case(2, 16, 8, 4, 2, torch.float32, seed=0)
    op = torch.ops.switchyard_cpu.moe_experts
    with pytest.raises(RuntimeError, match="gate_up \\[E, 2I, H\\]"):
        op(x, ids, weights, gate_up[:, :, :8].contiguous(), down)
    with pytest.raises(RuntimeError, match="the experts in x's dtype"):
        op(x, ids, weights, gate_up.bfloat16(), down)
    with pytest.raises(RuntimeError, match="int64 ids"):
        op(x, ids.int(), weights, gate_up, down)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, ids, weights, gate_up.transpose(1, 2), down)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.double(), ids, weights, gate_up.double(), down.double())


def test_a_sparse_mlp_on_the_cpu_kernels_runs_the_grouped_kernel() -> None:
    """MoEBlock with the CPU kernels keeps its float32 experts in plain rows and runs them in one moe_experts call
    per forward (not one oneDNN product per expert), with the same output as the reference kernels' block."""
    config = MoEConfig(hidden_size=64, num_experts=8, top_k=2, intermediate_size=48, renormalize=True,
                       names=QWEN_NAMES)
    torch.manual_seed(0)
    weights = {"model.layers.0.mlp.gate.weight": torch.randn(8, 64)}
    for e in range(8):
        for name, shape in (("gate_proj", (48, 64)), ("up_proj", (48, 64)), ("down_proj", (64, 48))):
            weights[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = 0.1 * torch.randn(shape)
    blocks = {}
    for name, kernels in (("cpu", select_kernels("cpu")), ("reference", LayerKernels())):
        blocks[name] = MoEBlock(config, kernels)
        blocks[name].load(weights, "model.layers.0")
    assert blocks["cpu"].packed is None and blocks["cpu"].gate_up.shape == (8, 96, 64)
    x = torch.randn(7, 64)
    with torch.profiler.profile() as prof:
        got = blocks["cpu"](x)
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith(("switchyard_cpu::", "mkldnn::"))}
    assert calls.get("switchyard_cpu::moe_experts") == 1 and not any(k.startswith("mkldnn::") for k in calls)
    torch.testing.assert_close(got, blocks["reference"](x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [3, cpu.NATIVE_BF16_EXPERT_TOKENS + 1])
def test_a_bf16_sparse_mlp_picks_the_kernel_or_atens_products_by_step_size(tokens: int) -> None:
    """bf16 experts stay in plain rows on every CPU. A decode-sized step runs moe_experts; where the CPU multiplies
    bf16 natively, a step of more than NATIVE_BF16_EXPERT_TOKENS tokens runs ATen's products over the same rows
    (AMX's tiles win there). Both agree with the float64 loop as closely as the op-by-op reference does."""
    config = MoEConfig(hidden_size=64, num_experts=8, top_k=2, intermediate_size=48, renormalize=True,
                       names=QWEN_NAMES)
    torch.manual_seed(tokens)
    weights = {"model.layers.0.mlp.gate.weight": torch.randn(8, 64)}
    for e in range(8):
        for name, shape in (("gate_proj", (48, 64)), ("up_proj", (48, 64)), ("down_proj", (64, 48))):
            weights[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = (0.1 * torch.randn(shape)).bfloat16()
    block = MoEBlock(config, select_kernels("cpu")).to(torch.bfloat16)
    block.load(weights, "model.layers.0")
    assert block.packed is None and block.gate_up.dtype == torch.bfloat16
    x = torch.randn(tokens, 64).bfloat16()
    with torch.profiler.profile() as prof:
        got = block(x)
    calls = {e.key: e.count for e in prof.key_averages()}
    kernel = not (cpu.native_bf16() and tokens > cpu.NATIVE_BF16_EXPERT_TOKENS)
    assert calls.get("switchyard_cpu::moe_experts", 0) == (1 if kernel else 0)
    route_weights, ids = block.route(x)
    want = naive_experts(x, ids, route_weights, block.gate_up, block.down)
    assert relative_error(got, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width, out", [(1, 64, 48), (4, 64, 40), (8, 2048, 33), (40, 50, 37)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_linear_matches_f_linear_in_float64(dtype: torch.dtype, rows: int, width: int, out: int,
                                                 with_bias: bool) -> None:
    """Rows of 1-40 (blocks of tokens and their tails; bf16 rows widened once past two blocks), widths and outputs
    that are no multiple of the vector or of the tile, a row of 2048 (the prefetch ahead of bf16 rows)."""
    g = torch.Generator().manual_seed(rows * width + out)
    x = torch.randn(rows, width, generator=g).to(dtype)
    weight = (torch.randn(out, width, generator=g) * width ** -0.5).to(dtype)
    bias = torch.randn(out, generator=g).to(dtype) if with_bias else None
    got = torch.ops.switchyard_cpu.rows_linear(x, weight, bias)
    assert got.shape == (rows, out) and got.dtype == dtype
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32: the order of the sums; bf16: one rounding of the result, as ATen's bf16 product rounds
    assert relative_error(got, want) < {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]


def test_rows_linear_bad_inputs_raise_instead_of_crashing() -> None:
    op = torch.ops.switchyard_cpu.rows_linear
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="weight \\[N, K\\]"):
        op(x, torch.randn(8, 15), None)
    with pytest.raises(RuntimeError, match="bias \\[N\\]"):
        op(x, weight, torch.randn(7))
    with pytest.raises(RuntimeError, match="the weight in x's dtype"):
        op(x, weight.bfloat16(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, torch.randn(16, 8).t(), None)


def test_bf16_projections_run_rows_linear_where_the_cpu_has_no_native_bf16() -> None:
    """A bf16 Linear (with its bias) and LM head on the CPU kernels: rows_linear where the CPU converts bf16 in
    software (AVX2), oneDNN's packed product where it multiplies bf16 natively; the same values either way."""
    kernels = select_kernels("cpu")
    torch.manual_seed(0)
    linear = Linear(64, 48, True, kernels).to(torch.bfloat16)
    linear.load([torch.randn(48, 64).bfloat16()], [torch.randn(48).bfloat16()])
    head = LMHead(64, 100, kernels).to(torch.bfloat16)
    head.load(torch.randn(100, 64).bfloat16())
    x = torch.randn(5, 64).bfloat16()
    with torch.profiler.profile() as prof:
        got_linear, got_head = linear(x), head(x)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("switchyard_cpu::rows_linear", 0) == (0 if cpu.native_bf16() else 2)
    weight = linear.weight if linear.packed is None else None
    if weight is not None:
        want = torch.nn.functional.linear(x.double(), weight.double(), linear.bias.double())
        assert relative_error(got_linear, want) < 8e-3
        assert relative_error(got_head, torch.nn.functional.linear(x.double(), head.weight.double())) < 8e-3
