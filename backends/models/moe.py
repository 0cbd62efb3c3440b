"""Mixture-of-experts layers the MoE model files share: the routers (plain functions, in float32), the grouped
expert products, and `MoEBlock`, the sparse MLP of a decoder layer (experts stacked, loaded from either the
per-expert or the fused checkpoint layout; over a tensor-parallel group, this rank's ExpertSplit of them). Pure
nn.Module and torch functions: nothing here asks the device.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backends.models.kernels.base import LayerKernels
from backends.models.layers import CompressedWeight, ExpandScratch, Linear, dense
from backends.models.tensor_parallel import ExpertSplit, TensorParallel, shared_expert_columns


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE routing: (weights [T, k] float32, expert ids [T, k] int64) of router logits [T, E].
    Softmax over all experts, the k largest, rescaled to sum to 1 when `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                       renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc routing: (weights [T, k] float32, expert ids [T, k] int64) of router logits [T, E].

    Sigmoid scores; the correction `bias` [E] steers the choice only: each of the `n_group` groups scores the sum
    of its two best biased scores, the best `topk_group` groups stay, and the k best biased scores among their
    experts are chosen. The weights are the un-biased scores of the chosen experts, rescaled to sum to 1 when
    `renormalize` (norm_topk_prob), times `scaling` (routed_scaling_factor)."""
    num_tokens, num_experts = logits.shape
    scores = logits.float().sigmoid()
    biased = scores + bias.float()
    grouped = biased.view(num_tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)   # [T, n_group]
    kept = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    ids = torch.topk(biased.masked_fill(~expert_mask, float("-inf")), k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """Experts' weights in the layout the kernels' packed_linear reads (LayerKernels.pack_expert), one per expert."""
    gate_up: tuple[torch.Tensor, ...]   # [2I, H] each, packed
    down: tuple[torch.Tensor, ...]      # [H, I] each, packed


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, kernels: LayerKernels, packed: PackedExperts | None = None) -> torch.Tensor:
    """sum_j w[t, j] * down[e] (silu_mul(gate_up[e] x[t])) with e = topk_ids[t, j]: [T, H] in, [T, H] out.

    The T*k token-slots are sorted by expert, so each active expert runs one matrix product over all of its
    tokens (gate_up [E, 2I, H], down [E, H, I], stored [out, in] as F.linear reads them); the results are
    weighted by the routing weights (float32) and summed per token. With `packed`, the products read those
    (gate_up and down may then be empty). An id past the last expert held (another rank's, under expert
    parallelism: ExpertSplit.local_ids) contributes nothing. The slots per expert are read on the host; while a
    CUDA graph is being captured, which allows no such read, every expert runs (`every_expert`). The weighted sum
    is the kernels' `combine_experts` where they have one."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return every_expert(x, topk_ids, topk_weights, gate_up, down, kernels)
    num_tokens, k = topk_ids.shape
    num_experts = len(packed.gate_up) if packed is not None else gate_up.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)            # [T*k] slots grouped by expert (foreign ones last)
    counts = torch.bincount(flat_ids, minlength=num_experts)[:num_experts].tolist()
    # index_select, not x[...] or index_add_: on CPU those took 5 and 50 ms for a few rows of 2048
    rows = x.index_select(0, order // k)                    # [T*k, H] tokens in expert order
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        if packed is not None:
            h = kernels.silu_mul(kernels.packed_linear(rows[start:end], packed.gate_up[expert], None))
            out[start:end] = kernels.packed_linear(h, packed.down[expert], None)
        else:
            h = kernels.silu_mul(F.linear(rows[start:end], gate_up[expert]))   # [count, I]
            torch.mm(h, down[expert].t(), out=out[start:end])
        start = end
    out[start:] = 0   # the slots of experts another rank holds
    combined = kernels.combine_experts(out, order, topk_weights)
    if combined is not None:
        return combined
    per_slot = out.index_select(0, torch.argsort(order)).view(num_tokens, k, -1)   # back in slot order
    # the weighted sum over each token's k experts, in float32: [T, 1, k] @ [T, k, H]
    return torch.bmm(topk_weights.float().unsqueeze(1), per_slot.float()).squeeze(1).to(x.dtype)


def every_expert(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, kernels: LayerKernels) -> torch.Tensor:
    """grouped_experts with no read on the host (so a CUDA graph can capture it): every expert over every token,
    weighted by its routing weight or 0. E products of T rows: for decode batches that choose most experts
    anyway about the same weight bytes."""
    result = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        weight = (topk_weights.float() * (topk_ids == expert)).sum(dim=1, keepdim=True)   # [T, 1]
        h = kernels.silu_mul(F.linear(x, gate_up[expert]))
        result += weight * F.linear(h, down[expert]).float()
    return result.to(x.dtype)


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """Where a family's checkpoint keeps a sparse MLP's tensors, under the decoder layer's prefix."""
    block: str        # the sparse MLP's module: "mlp" (Qwen-MoE, DeepSeek), "block_sparse_moe" (Mixtral)
    gate: str         # per-expert projection names: gate ("w1", "gate_proj"), up ("w3", "up_proj") ...
    up: str
    down: str         # ... and down ("w2", "down_proj")
    shared: str = "shared_experts"   # the shared expert's module (Qwen2-MoE: "shared_expert")


MIXTRAL_NAMES = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
QWEN_NAMES = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse MLP's shape and routing, read from the model's config by the model file."""
    hidden_size: int
    num_experts: int
    top_k: int                              # experts per token
    intermediate_size: int                  # per expert
    renormalize: bool                       # top-k weights rescaled to sum to 1 (norm_topk_prob)
    names: ExpertNames
    shared_intermediate_size: int = 0       # 0: no shared expert; else its (summed) width
    shared_expert_gated: bool = False       # Qwen2-MoE: the shared expert scaled by sigmoid(gate(x))


class MoEBlock(nn.Module):
    """The sparse MLP: a float32 router, top-k softmax routing, grouped expert products; optionally a shared
    expert added for every token. `route` may be replaced by a family with its own routing (DeepSeek-V3).

    With `tp`: this rank's ExpertSplit of the experts (every expert's columns, or whole experts with expert
    parallelism) under the replicated router, and its columns of the shared expert (in either mode, as a dense
    MLP's); the routed and shared partial outputs are added, then summed over the ranks by one all-reduce, the
    residual added by rank 0 alone."""

    def __init__(self, config: MoEConfig, kernels: LayerKernels, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.tp = tp
        self.split = None if tp is None else ExpertSplit.of(config.num_experts, config.intermediate_size, tp.rank,
                                                            tp.size, tp.expert_parallel)
        hidden = config.hidden_size
        experts = config.num_experts if self.split is None else self.split.num_experts
        inter = config.intermediate_size if self.split is None else self.split.intermediate
        self.gate = nn.Parameter(torch.empty(config.num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(experts, hidden, inter), requires_grad=False)
        shared = (config.shared_intermediate_size if tp is None
                  else shared_expert_columns(config.shared_intermediate_size, tp.size))
        self.shared_gate_up = Linear(hidden, 2 * shared, False, kernels) if shared else None
        self.shared_down = Linear(shared, hidden, False, kernels) if shared else None
        self.shared_gate = (nn.Parameter(torch.empty(1, hidden, dtype=torch.float32), requires_grad=False)
                            if shared and config.shared_expert_gated else None)
        self.packed: PackedExperts | None = None   # where the kernels pack experts; gate_up and down are then empty

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of x [T, H]."""
        logits = F.linear(x.float(), self.gate.float())   # [T, E]; .float() is free once load made it float32
        return softmax_topk(logits, self.config.top_k, self.config.renormalize)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE output for x [T, H], plus `residual` when given."""
        weights, ids = self.route(x)
        if self.split is not None:
            ids = self.split.local_ids(ids)
        own_kernel = self.packed is None and (self.split is None or not self.split.expert_parallel
                                              or self.kernels.skips_foreign_experts)
        out = self.kernels.expert_products(x, ids, weights, self.gate_up, self.down) if own_kernel else None
        if out is None:
            out = grouped_experts(x, ids, weights, self.gate_up, self.down, self.kernels, self.packed)
        if self.shared_gate_up is not None and self.shared_down is not None:
            shared = self.shared_down(self.kernels.silu_mul(self.shared_gate_up(x)))
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x.float(), self.shared_gate.float())).to(shared.dtype)
            out = out + shared
        if self.tp is not None:   # the ranks' partial sums; the replicated residual added once, by rank 0
            return self.tp.all_reduce(out if residual is None or self.tp.rank != 0 else residual + out)
        return out if residual is None else residual + out

    def load(self, weights: Mapping[str, torch.Tensor | CompressedWeight], layer_prefix: str,
             scratch: ExpandScratch | None = None) -> None:
        """Copy the block's tensors in from HF names under `layer_prefix` ("model.layers.3"): the router, the
        experts per expert (`{block}.experts.{e}.{gate|up|down}.weight`) or fused (`{block}.experts.gate_up_proj`
        [E, 2I, H], `{block}.experts.down_proj` [E, H, I]), and the shared expert. Experts are expanded once, and
        packed where the kernels pack them.
        `{block}` may also be `mlp`, transformers 5's module name in every family (its state_dict)."""
        names = self.config.names
        prefix = next((p for p in (f"{layer_prefix}.{names.block}", f"{layer_prefix}.mlp")
                       if f"{p}.gate.weight" in weights), f"{layer_prefix}.{names.block}")
        # the router stays float32 whatever the model's dtype (the runner gives every parameter the model's)
        self.gate = _float32(weights[f"{prefix}.gate.weight"], self.gate_up.device)
        if f"{prefix}.experts.gate_up_proj" in weights:
            if self.split is not None:   # a rank would read every expert whole to keep its part
                raise ValueError("fused expert tensors (experts.gate_up_proj) cannot be split over a "
                                 "tensor-parallel group yet; save the checkpoint with per-expert tensors")
            self.gate_up.copy_(dense(weights[f"{prefix}.experts.gate_up_proj"]))
            self.down.copy_(dense(weights[f"{prefix}.experts.down_proj"]))
        else:
            first = 0 if self.split is None else self.split.first_expert
            inter = self.gate_up.shape[1] // 2   # this rank's columns of each expert
            for e in range(self.gate_up.shape[0]):   # this rank's experts, whose slices the reader gives
                expert = f"{prefix}.experts.{first + e}"
                self.gate_up[e, :inter].copy_(dense(weights[f"{expert}.{names.gate}.weight"]))
                self.gate_up[e, inter:].copy_(dense(weights[f"{expert}.{names.up}.weight"]))
                self.down[e].copy_(dense(weights[f"{expert}.{names.down}.weight"]))
        self._pack()
        if self.shared_gate_up is not None and self.shared_down is not None:
            shared = f"{prefix}.{names.shared}"
            self.shared_gate_up.load([weights[f"{shared}.gate_proj.weight"], weights[f"{shared}.up_proj.weight"]],
                                     None, scratch)
            self.shared_down.load([weights[f"{shared}.down_proj.weight"]], None, scratch)
            if self.shared_gate is not None:
                self.shared_gate = _float32(weights[f"{prefix}.shared_expert_gate.weight"], self.gate_up.device)

    def _pack(self) -> None:
        """Experts packed where the kernels pack them; the packed copies replace the stacked ones."""
        num_experts = self.gate_up.shape[0]
        gate_up = [self.kernels.pack_expert(self.gate_up[e]) for e in range(num_experts)]
        down = [self.kernels.pack_expert(self.down[e]) for e in range(num_experts)]
        packed_gate_up = [w for w in gate_up if w is not None]
        packed_down = [w for w in down if w is not None]
        if len(packed_gate_up) == len(packed_down) == num_experts:
            self.packed = PackedExperts(tuple(packed_gate_up), tuple(packed_down))
            empty = torch.empty(0, dtype=self.gate_up.dtype, device=self.gate_up.device)
            self.gate_up = nn.Parameter(empty, requires_grad=False)
            self.down = nn.Parameter(empty.clone(), requires_grad=False)


def _float32(weight: torch.Tensor | CompressedWeight, device: torch.device) -> nn.Parameter:
    return nn.Parameter(dense(weight).to(device=device, dtype=torch.float32), requires_grad=False)
