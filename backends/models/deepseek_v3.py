"""DeepSeek-V3 (the Kimi K2 architecture): multi-head latent attention over a paged cache of the compressed latent,
dense first layers, then sparse MLPs with shared experts and DeepSeek's group-limited sigmoid routing.

Pure nn.Module over flat token batches ([num_tokens, ...]). The cache keeps per token only the normed latent c_kv
(kv_lora_rank) and the rotated k_pe (qk_rope_head_dim), never the per-head K and V: queries are absorbed into the
latent space through W_UK and the attention output leaves it through W_UV (absorbed form, prefill and decode).
With `tp=`, one rank's shard: its query heads (the latent, which all heads read, replicated and cached on every
rank), its MLP and shared-expert columns, its ExpertSplit of the routed experts, its vocabulary rows.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from backends.attention.base import AttentionContext
from backends.models.base import LayerKVSpec
from backends.models.kernels.base import LayerKernels
from backends.models.layers import (
    CompressedWeight,
    ExpandScratch,
    Linear,
    LMHead,
    RMSNorm,
    dense,
    embedding_and_head,
    on_first_stage,
)
from backends.models.llama import LlamaMLP
from backends.models.model_config import ModelConfig
from backends.models.moe import QWEN_NAMES, MoEBlock, MoEConfig, sigmoid_group_topk
from backends.models.pipeline import PipelineStage
from backends.models.tensor_parallel import TensorParallel, TPLayout, vocab_parallel_embed


class DeepseekV3Config(ModelConfig, Protocol):
    """The fields of DeepSeek-V3's config the model reads without a default."""
    kv_lora_rank: int        # channels of the compressed latent c_kv
    qk_rope_head_dim: int    # rotary channels per head (and of the shared k_pe)
    qk_nope_head_dim: int    # channels per head of q and k without rotary
    v_head_dim: int          # channels per head of v
    first_k_dense_replace: int    # the first layers keep a dense MLP
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int    # per routed expert
    n_shared_experts: int         # the shared expert is this many experts wide
    n_group: int                  # expert groups ...
    topk_group: int               # ... of which the tokens' best groups are kept
    routed_scaling_factor: float


def _rope_params(config: ModelConfig) -> dict[str, Any]:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(config: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2], the factor cos and sin are scaled by) for default or YaRN rotary,
    as transformers computes them (modeling_rope_utils._compute_yarn_parameters)."""
    params = _rope_params(config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise NotImplementedError(f"rope type {kind!r} is not supported by DeepseekV3ForCausalLM")
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / old_len
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp   # 1: the original frequency, 0: interpolated by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(config: ModelConfig, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under YaRN (transformers'
    yarn_apply_mscale)."""
    params = _rope_params(config)
    scale = qk_head_dim ** -0.5
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def interleaved_to_halves(rows: int) -> torch.Tensor:
    """The row order that turns a projection's interleaved rotary pairs (x0, x1), (x2, x3)... into rotate-half's
    layout (evens, then odds): transformers' apply_rotary_pos_emb_interleave is rotate-half on that layout."""
    return torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))


class LatentAttention(nn.Module):
    """MLA: q (optionally through a low-rank q_a/q_b), the latent [c_kv, k_pe] cached, absorbed attention.

    With `tp`: this rank's query heads (q / q_b rows, W_UK and W_UV of kv_b, o_proj's columns: row-parallel, one
    all-reduce); q_a, kv_a_proj_with_mqa and their norms replicated, so every rank computes and caches the whole
    latent (vLLM's MLA does the same)."""

    def __init__(self, config: ModelConfig, layer: int, kernels: LayerKernels,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer, self.kernels, self.tp = layer, kernels, tp
        dims = cast(DeepseekV3Config, config)
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads if tp is None else TPLayout.of(config, tp.rank, tp.size).num_heads
        self.q_lora_rank: int | None = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank, self.rope_dim = int(dims.kv_lora_rank), int(dims.qk_rope_head_dim)
        self.nope_dim, self.v_dim = int(dims.qk_nope_head_dim), int(dims.v_head_dim)
        bias = bool(getattr(config, "attention_bias", False))
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(hidden, q_size, False, kernels)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm: RMSNorm | None = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, kernels)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, kernels)
            self.q_b_proj = Linear(self.q_lora_rank, q_size, False, kernels)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias, kernels)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, kernels)
        # kv_b_proj split per head: W_UK absorbs q_nope into the latent, W_UV takes the output out of it
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope_dim, self.kv_lora_rank), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.v_dim, self.kv_lora_rank), requires_grad=False)
        # a row-parallel bias is added once, by rank 0
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias and (tp is None or tp.rank == 0), kernels)
        self.latent_dim = self.kv_lora_rank + self.rope_dim
        self.cached_half = -(-self.latent_dim // 2)   # channels of the latent in each of the K and V caches
        self.scale = softmax_scale(config, self.nope_dim + self.rope_dim)

    def kv_spec(self) -> LayerKVSpec:
        return LayerKVSpec(num_heads=self.num_heads, num_kv_heads=1, head_dim=self.cached_half, scale=self.scale,
                           latent_value_dim=self.kv_lora_rank)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext,
                residual: torch.Tensor) -> torch.Tensor:
        num_tokens, heads = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, heads, self.nope_dim + self.rope_dim)
        latent = self.kv_a_proj_with_mqa(x)   # [num_tokens, kv_lora_rank + rope_dim]
        c_kv = self.kv_a_layernorm(latent[:, :self.kv_lora_rank])
        pe = torch.cat((q[:, :, self.nope_dim:], latent[:, None, self.kv_lora_rank:]), dim=1)
        pe = self.kernels.rotate(pe, cos, sin)   # [num_tokens, heads + 1, rope_dim]: q_pe of every head, then k_pe
        # q_nope absorbed: [heads, num_tokens, nope] x [heads, nope, kv_lora_rank]
        q_latent = torch.bmm(q[:, :, :self.nope_dim].transpose(0, 1), self.w_uk).transpose(0, 1)
        pad = 2 * self.cached_half - self.latent_dim   # one zero channel when the latent's width is odd
        query = F.pad(torch.cat((q_latent, pe[:, :heads]), dim=-1), (0, pad))   # [num_tokens, heads, 2 * half]
        cached = F.pad(torch.cat((c_kv, pe[:, heads]), dim=-1), (0, pad)).view(num_tokens, 1, -1)
        out = attn(self.layer, query, cached[..., :self.cached_half], cached[..., self.cached_half:])
        # out [num_tokens, heads, kv_lora_rank] leaves the latent: x [heads, kv_lora_rank, v_dim]
        out = torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)
        out = out.reshape(num_tokens, heads * self.v_dim)
        if self.tp is None:
            return self.o_proj(out, residual)
        # the ranks' partial products summed; the replicated residual added by rank 0 alone
        return self.tp.all_reduce(self.o_proj(out, residual if self.tp.rank == 0 else None))

    def load(self, weights: Mapping[str, torch.Tensor | CompressedWeight], prefix: str, interleaved: bool,
             scratch: ExpandScratch | None) -> None:
        """Copy `{prefix}.self_attn.*` in; interleaved rotary rows are reordered into rotate-half's layout."""
        p = f"{prefix}.self_attn"
        head = self.nope_dim + self.rope_dim
        order = torch.arange(self.num_heads * head).view(self.num_heads, head)
        rope_rows = interleaved_to_halves(self.rope_dim) if interleaved else torch.arange(self.rope_dim)
        q_order = torch.cat((order[:, :self.nope_dim], order[:, self.nope_dim:][:, rope_rows]), dim=1).reshape(-1)
        kv_order = torch.cat((torch.arange(self.kv_lora_rank), self.kv_lora_rank + rope_rows))
        if self.q_proj is not None:
            self.q_proj.load([dense(weights[f"{p}.q_proj.weight"])[q_order]], None)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            self.q_a_proj.load([weights[f"{p}.q_a_proj.weight"]], _maybe(weights, f"{p}.q_a_proj.bias"), scratch)
            self.q_a_layernorm.weight.copy_(dense(weights[f"{p}.q_a_layernorm.weight"]))
            self.q_b_proj.load([dense(weights[f"{p}.q_b_proj.weight"])[q_order]], None)
        kv_a_bias = _maybe(weights, f"{p}.kv_a_proj_with_mqa.bias")
        self.kv_a_proj_with_mqa.load([dense(weights[f"{p}.kv_a_proj_with_mqa.weight"])[kv_order]],
                                     None if kv_a_bias is None else [kv_a_bias[0][kv_order]])
        self.kv_a_layernorm.weight.copy_(dense(weights[f"{p}.kv_a_layernorm.weight"]))
        kv_b = dense(weights[f"{p}.kv_b_proj.weight"]).view(self.num_heads, self.nope_dim + self.v_dim, -1)
        self.w_uk.copy_(kv_b[:, :self.nope_dim])
        self.w_uv.copy_(kv_b[:, self.nope_dim:])
        self.o_proj.load([weights[f"{p}.o_proj.weight"]], _maybe(weights, f"{p}.o_proj.bias"), scratch)


class DeepseekV3MoE(MoEBlock):
    """The sparse MLP with DeepSeek-V3's routing: sigmoid scores, the correction bias, group-limited top-k."""

    def __init__(self, config: DeepseekV3Config, kernels: LayerKernels, tp: TensorParallel | None = None) -> None:
        super().__init__(MoEConfig(
            hidden_size=config.hidden_size, num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size, renormalize=bool(getattr(config, "norm_topk_prob", True)),
            names=QWEN_NAMES, shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts),
            kernels, tp)
        self.n_group, self.topk_group = int(config.n_group), int(config.topk_group)
        self.scaling = float(config.routed_scaling_factor)
        self.correction_bias = nn.Parameter(torch.empty(config.n_routed_experts, dtype=torch.float32),
                                            requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.float())   # [num_tokens, experts], float32
        return sigmoid_group_topk(logits, self.correction_bias, self.config.top_k, self.n_group, self.topk_group,
                                  self.config.renormalize, self.scaling)

    def load(self, weights: Mapping[str, torch.Tensor | CompressedWeight], layer_prefix: str,
             scratch: ExpandScratch | None = None) -> None:
        super().load(weights, layer_prefix, scratch)
        bias = dense(weights[f"{layer_prefix}.mlp.gate.e_score_correction_bias"])
        self.correction_bias = nn.Parameter(bias.to(self.gate.device, torch.float32), requires_grad=False)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, kernels: LayerKernels,
                 tp: TensorParallel | None = None, cache_index: int | None = None) -> None:
        """`layer`: its index in the model; `cache_index`: its KV cache's among the runner's (`layer` unless a
        pipeline stage holds it)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = LatentAttention(config, layer if cache_index is None else cache_index, kernels, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        dims = cast(DeepseekV3Config, config)
        self.mlp: LlamaMLP | DeepseekV3MoE = (LlamaMLP(config, kernels, tp) if layer < dims.first_k_dense_replace
                                              else DeepseekV3MoE(dims, kernels, tp))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, attn, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def load(self, weights: Mapping[str, torch.Tensor | CompressedWeight], prefix: str, interleaved: bool,
             scratch: ExpandScratch | None) -> None:
        self.self_attn.load(weights, prefix, interleaved, scratch)
        self.mlp.load(weights, prefix, scratch)
        self.input_layernorm.weight.copy_(dense(weights[f"{prefix}.input_layernorm.weight"]))
        self.post_attention_layernorm.weight.copy_(dense(weights[f"{prefix}.post_attention_layernorm.weight"]))


class DeepseekV3ForCausalLM(nn.Module):
    """Token ids + positions in, hidden states out (backends.models.base.CausalLM). `tp`: build this rank's shard
    (backends/models/tensor_parallel.py), the embedding and LM head by vocabulary rows as Llama's. `stage`: only a
    pipeline stage's layers (backends/models/pipeline.py), the embedding and LM head on the first stage alone."""

    def __init__(self, config: ModelConfig, kernels: LayerKernels, *, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.tp = tp
        self.stage = stage
        self.tp_layout = None if tp is None else TPLayout.of(config, tp.rank, tp.size, tp.expert_parallel)
        vocab_rows = config.vocab_size if self.tp_layout is None else self.tp_layout.vocab
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: LMHead | None = None
        if stage is None or stage.is_first:
            self.embed_tokens, self.lm_head = embedding_and_head(config, kernels, vocab_rows)
        held = PipelineStage.layers_of(stage, config.num_hidden_layers)
        self.first_layer = held.start
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i, kernels, tp, cache_index=i - held.start)
                                    for i in held)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        with torch.device("cpu"):   # a plain attribute, kept float32, moved to the positions' device on first use
            rope_dim = int(cast(DeepseekV3Config, config).qk_rope_head_dim)
            self.inv_freq, self.attention_factor = rope_tables(config, rope_dim)

    def decoder_layer(self, index: int) -> DeepseekV3DecoderLayer:
        layer = self.layers[index]
        assert isinstance(layer, DeepseekV3DecoderLayer)
        return layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """A later pipeline stage starts from `hidden`; one before the last returns its residual stream, not normed."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = self.kernels.rotary_tables(self.inv_freq, positions, self.norm.weight.dtype)
        if self.attention_factor != 1.0:   # YaRN scales both tables (a rotation scaled: linear in each)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        x = self.embed(input_ids) if hidden is None else hidden
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x) if self.stage is None or self.stage.is_last else x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = on_first_stage(self.embed_tokens)
        if self.tp is None or self.tp_layout is None:
            return table(input_ids)
        return vocab_parallel_embed(table.weight, input_ids, self.tp_layout, self.tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Over a group: rank 0 gets every rank's vocabulary columns (the padding past the vocabulary cut)."""
        head = on_first_stage(self.lm_head)
        if self.tp is None:
            return head(hidden)
        return self.tp.gather_vocab(head(hidden))[:, :self.config.vocab_size]

    def lm_head_weight(self) -> torch.Tensor:
        return on_first_stage(self.lm_head).weight

    def kv_cache_spec(self) -> tuple[LayerKVSpec, ...]:
        return tuple(self.decoder_layer(i).self_attn.kv_spec() for i in range(len(self.layers)))

    def load_weights(self, weights: Mapping[str, torch.Tensor | CompressedWeight],
                     keep_compressed: bool = False) -> None:
        scratch = ExpandScratch() if keep_compressed else None
        interleaved = bool(getattr(self.config, "rope_interleave", True))
        for i in range(len(self.layers)):
            self.decoder_layer(i).load(weights, f"model.layers.{self.first_layer + i}", interleaved, scratch)
        self.norm.weight.copy_(dense(weights["model.norm.weight"]))
        if self.embed_tokens is None or self.lm_head is None:   # a later pipeline stage
            return
        embed = self._vocab_rows(dense(weights["model.embed_tokens.weight"]))
        self.embed_tokens.weight.copy_(embed)
        tied = getattr(self.config, "tie_word_embeddings", False)
        self.lm_head.load(embed if tied else self._vocab_rows(dense(weights["lm_head.weight"])))

    def _vocab_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A rank's vocabulary rows padded with zeros to its share (the last rank's may run past the vocabulary)."""
        missing = on_first_stage(self.embed_tokens).weight.shape[0] - rows.shape[0]
        return rows if missing <= 0 else torch.cat((rows, rows.new_zeros(missing, rows.shape[1])))


def _maybe(weights: Mapping[str, torch.Tensor | CompressedWeight], name: str) -> list[torch.Tensor] | None:
    return [dense(weights[name])] if name in weights else None
