"""The MoE layers against plain references: grouped_experts against a loop over tokens, the routers against
transformers' own router modules on random logits."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from backends.models.kernels.base import LayerKernels
from backends.models.kernels.registry import select_kernels
from backends.models.moe import grouped_experts, sigmoid_group_topk, softmax_topk

HIDDEN, INTER, EXPERTS = 48, 40, 8


def naive_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """One token, one chosen expert at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("kernels", [LayerKernels(), select_kernels("cpu")], ids=["reference", "cpu"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_grouped_experts_match_a_loop_over_tokens(kernels: LayerKernels, dtype: torch.dtype, tolerance: float,
                                                  num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2).to(dtype)
    weights, ids = softmax_topk(torch.randn(num_tokens, EXPERTS, generator=g), 2, renormalize=True)
    got = grouped_experts(x, ids, weights, gate_up, down, kernels)
    assert got.shape == x.shape and got.dtype == dtype
    want = naive_experts(x, ids, weights, gate_up, down)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < tolerance


def test_grouped_experts_with_a_token_twice_on_one_expert_slot_order() -> None:
    """Slots of one token on several experts, and experts no token chose, in any order of ids."""
    x = torch.randn(4, HIDDEN)
    gate_up, down = torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.2, torch.randn(EXPERTS, HIDDEN, INTER) * 0.2
    ids = torch.tensor([[7, 0], [0, 7], [3, 5], [5, 3]])
    weights = torch.rand(4, 2)
    got = grouped_experts(x, ids, weights, gate_up, down, LayerKernels())
    torch.testing.assert_close(got.double(), naive_experts(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-5)


def hf_router(cls: type, config: SimpleNamespace, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of transformers' router `cls` on `hidden`, its weight the identity (logits = hidden)."""
    router = cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(config.num_local_experts, config.hidden_size))
        _, weights, ids = router(hidden)
    return weights.float(), ids


def sorted_pairs(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_matches_transformers_routers(renormalize: bool) -> None:
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) * 3
    config = SimpleNamespace(num_experts_per_tok=4, num_local_experts=16, num_experts=16, hidden_size=16,
                             norm_topk_prob=renormalize)
    cls = MixtralTopKRouter if renormalize else Qwen3MoeTopKRouter   # Mixtral always renormalizes
    want_w, want_ids = sorted_pairs(*hf_router(cls, config, logits))
    got_w, got_ids = sorted_pairs(*softmax_topk(logits, 4, renormalize))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(got_w, sorted_pairs(*hf_router(Qwen3MoeTopKRouter, config, logits))[0])


@pytest.mark.parametrize("renormalize, scaling", [(True, 2.5), (False, 1.0)])
def test_sigmoid_group_topk_matches_deepseek_v3s_router(renormalize: bool, scaling: float) -> None:
    g = torch.Generator().manual_seed(2)
    experts = 32
    logits, bias = torch.randn(50, experts, generator=g) * 2, torch.randn(experts, generator=g) * 0.5
    config = SimpleNamespace(num_experts_per_tok=6, num_local_experts=experts, hidden_size=experts,
                             routed_scaling_factor=scaling, n_group=8, topk_group=3, norm_topk_prob=renormalize)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
        router.e_score_correction_bias.copy_(bias)
        _, want_w, want_ids = router(logits)
    want_w, want_ids = sorted_pairs(want_w, want_ids)
    got_w, got_ids = sorted_pairs(*sigmoid_group_topk(logits, bias, 6, 8, 3, renormalize, scaling))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    # the bias moved some choice away from the plain top-k of the scores, so it was exercised
    plain = sigmoid_group_topk(logits, torch.zeros(experts), 6, 8, 3, renormalize, scaling)[1]
    assert not torch.equal(sorted_pairs(*sigmoid_group_topk(logits, bias, 6, 8, 3, renormalize, scaling))[1],
                           plain.sort(dim=-1).values)
