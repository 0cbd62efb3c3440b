"""The MoE layers against plain references: grouped_experts against a loop over tokens, the routers against
transformers' own router modules on random logits, MoEBlock with a shared expert against transformers' block."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from backends.models.kernels.base import LayerKernels
from backends.models.kernels.registry import select_kernels
from backends.models.moe import (
    QWEN_NAMES,
    MoEBlock,
    MoEConfig,
    PackedExperts,
    every_expert,
    grouped_experts,
    sigmoid_group_topk,
    softmax_topk,
)
from backends.models.tensor_parallel import ExpertSplit

HIDDEN, INTER, EXPERTS = 48, 40, 8


def naive_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """One token, one chosen expert at a time, in float64; an id outside the experts held adds nothing."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up.shape[0]:
                continue
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
    want = naive_experts(x, ids, weights, gate_up, down)
    runs = {"grouped": grouped_experts(x, ids, weights, gate_up, down, kernels),
            "every expert": every_expert(x, ids, weights, gate_up, down, kernels)}   # what a CUDA graph captures
    packed = [(kernels.pack_expert(gate_up[e]), kernels.pack_expert(down[e])) for e in range(EXPERTS)]
    if all(g is not None and d is not None for g, d in packed):   # the CPU's, where it packs this dtype
        experts = PackedExperts(tuple(g for g, _ in packed), tuple(d for _, d in packed))
        runs["packed"] = grouped_experts(x, ids, weights, gate_up[:0], down[:0], kernels, experts)
    for name, got in runs.items():
        assert got.shape == x.shape and got.dtype == dtype
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < tolerance, name


@pytest.mark.parametrize("kernels", [LayerKernels(), select_kernels("cpu")], ids=["reference", "cpu"])
def test_grouped_experts_with_a_token_twice_on_one_expert_slot_order(kernels: LayerKernels) -> None:
    """Slots of one token on several experts, experts no token chose, and another rank's (id EXPERTS, adding
    nothing), in any order of ids."""
    x = torch.randn(5, HIDDEN)
    gate_up, down = torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.2, torch.randn(EXPERTS, HIDDEN, INTER) * 0.2
    ids = torch.tensor([[7, 0], [0, 7], [3, 5], [5, 3], [EXPERTS, 2]])
    weights = torch.rand(5, 2)
    got = grouped_experts(x, ids, weights, gate_up, down, kernels)
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


@pytest.mark.parametrize("kernels", [LayerKernels(), select_kernels("cpu")], ids=["reference", "cpu"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_block_with_a_gated_shared_expert_matches_qwen2_moes_block(renormalize: bool,
                                                                        kernels: LayerKernels) -> None:
    """MoEBlock's routing, experts and shared expert (sigmoid-gated, Qwen2-MoE) against transformers' own block,
    loaded from that block's state_dict (the fused expert layout) under a layer's prefix."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, shared_expert_intermediate_size=56,
                            num_experts=EXPERTS, num_experts_per_tok=3, norm_topk_prob=renormalize)
    torch.manual_seed(3)
    theirs = Qwen2MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    ours = MoEBlock(MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=3, intermediate_size=INTER,
                              renormalize=renormalize, names=replace(QWEN_NAMES, shared="shared_expert"),
                              shared_intermediate_size=56, shared_expert_gated=True), kernels)
    with torch.no_grad():
        ours.load({f"model.layers.0.mlp.{name}": t for name, t in theirs.state_dict().items()}, "model.layers.0")
    x = torch.randn(1, 11, HIDDEN)
    with torch.inference_mode():
        want, got = theirs(x)[0], ours(x[0], residual=x[0]) - x[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _SummedLater:
    """One rank's view of a group of `size` whose all-reduce the test does itself (by summing the ranks' outputs)."""

    def __init__(self, rank: int, size: int, expert_parallel: bool) -> None:
        self.rank, self.size, self.expert_parallel = rank, size, expert_parallel

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a sparse MLP gathers no logits")

    def agree_min(self, value: int) -> int:
        return value


@pytest.mark.parametrize("shared", [0, 2 * INTER], ids=["routed", "with_shared"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_ranks_moe_shards_sum_to_the_whole_block(expert_parallel: bool, shared: int) -> None:
    """Each rank's shard (every expert's columns, or whole experts; a shared expert's columns in either mode, as
    DeepSeek-V3's) loaded from its slices of the same tensors, run on the same tokens: their outputs, rank 0's with
    the residual, sum to the single block's plus the residual."""
    torch.manual_seed(0)
    config = MoEConfig(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=2, intermediate_size=INTER, renormalize=True,
                       names=QWEN_NAMES, shared_intermediate_size=shared)
    weights = {"model.layers.0.mlp.gate.weight": torch.randn(EXPERTS, HIDDEN)}
    experts = [(f"experts.{e}", INTER) for e in range(EXPERTS)] + ([("shared_experts", shared)] if shared else [])
    for expert, width in experts:
        for name, shape in (("gate_proj", (width, HIDDEN)), ("up_proj", (width, HIDDEN)),
                            ("down_proj", (HIDDEN, width))):
            weights[f"model.layers.0.mlp.{expert}.{name}.weight"] = 0.1 * torch.randn(shape)
    kernels = select_kernels("cpu")
    whole = MoEBlock(config, kernels)
    whole.load(weights, "model.layers.0")
    x, residual = torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)
    parts = []
    for rank in range(2):
        block = MoEBlock(config, kernels, _SummedLater(rank, 2, expert_parallel))
        split = block.split
        assert split is not None
        block.load({n: _slice(t, _rows(n, split, rank, shared // 2)) for n, t in weights.items()}, "model.layers.0")
        parts.append(block(x, residual))
    torch.testing.assert_close(parts[0] + parts[1], whole(x, residual), rtol=1e-5, atol=1e-5)


def _rows(name: str, split: ExpertSplit, rank: int, shared: int) -> tuple[int, int, int] | None:
    """What TPLayout.rows_of names for a sparse MLP's tensor: a routed expert's by `split`, the shared expert's
    `shared` columns of rank `rank` (gate / up rows, down columns), the router whole."""
    part = name.rsplit(".", 2)[-2]
    if ".experts." in name:
        return split.rows_of(part)
    if ".shared_experts." in name:
        return (0 if part != "down_proj" else 1), rank * shared, (rank + 1) * shared
    return None


def _slice(tensor: torch.Tensor, rows: tuple[int, int, int] | None) -> torch.Tensor:
    """What the shard reader gives a rank of `tensor`: its (dim, start, stop), or all of it."""
    if rows is None:
        return tensor
    dim, start, stop = rows
    return tensor.narrow(dim, start, stop - start)
