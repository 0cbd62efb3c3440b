"""The Llama-family decoder (Llama, SmolLM2, Mistral; Qwen2/Qwen3 subclass it) over a paged KV cache.

Pure nn.Module over flat token batches ([num_tokens, ...], no batch dim): attention goes through the
`AttentionContext` the runner passes in. Weights are fused at load (qkv, gate_up).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, cast

import torch
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
    rope_inv_freq,
)
from backends.models.model_config import ModelConfig
from backends.models.pipeline import PipelineStage
from backends.models.tensor_parallel import TensorParallel, TPLayout, vocab_parallel_embed


class LlamaAttention(nn.Module):
    """With `tp`: this rank's heads (TPLayout); qkv_proj column-parallel, o_proj row-parallel, one all-reduce.
    `layer`: which of the runner's KV caches is this layer's (its index within the stage that holds it)."""

    def __init__(self, config: ModelConfig, layer: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 kernels: LayerKernels, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.kernels = kernels
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        if tp is not None:
            layout = TPLayout.of(config, tp.rank, tp.size)
            self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, qkv_bias, kernels)
        # a row-parallel bias is added once, by rank 0, before the all-reduce sums the ranks' parts
        self.o_proj = Linear(q_size, config.hidden_size, o_bias and (tp is None or tp.rank == 0), kernels)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None

    def kv_spec(self) -> LayerKVSpec:
        return LayerKVSpec(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           scale=self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output, plus `residual` when given (added inside o_proj's matrix product on CUDA)."""
        num_tokens, heads, kv_heads, head_dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        # where the kernels have it, one kernel: rotary on q and k, k and v into the cache, q out of qkv
        q = None if self.q_norm is not None else self.kernels.rotary_store(
            qkv, cos, sin, heads, kv_heads, attn.k_caches[self.layer], attn.v_caches[self.layer], attn.slot_mapping)
        if q is not None:
            out = attn.attend(self.layer, q)
        else:
            qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
            if self.q_norm is not None and self.k_norm is not None:   # both or neither
                qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
            qk = self.kernels.rotate(qk, cos, sin)  # q and k rotated in one pass
            out = attn(self.layer, qk[:, :heads], qk[:, heads:], v)  # [num_tokens, heads, head_dim]
        out = out.reshape(num_tokens, heads * head_dim)
        if self.tp is None:
            return self.o_proj(out, residual)
        return _row_parallel(self.o_proj, out, residual, self.tp)


class DecoderMLP(Protocol):
    """A decoder layer's feed-forward block: LlamaMLP, or a sparse one (backends.models.moe.MoEBlock)."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...

    def load(self, weights: Mapping[str, torch.Tensor | CompressedWeight], layer_prefix: str,
             scratch: ExpandScratch | None) -> None: ...


# (config, layer index, kernels, this rank's group or None) -> the layer's feed-forward block (a DecoderMLP
# nn.Module; with a group, this rank's shard of it)
MLPFactory = Callable[[ModelConfig, int, LayerKernels, TensorParallel | None], nn.Module]


class LlamaMLP(nn.Module):
    """With `tp`: this rank's MLP columns; gate_up column-parallel, down_proj row-parallel, one all-reduce."""

    def __init__(self, config: ModelConfig, kernels: LayerKernels, tp: TensorParallel | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.kernels = kernels
        self.tp = tp
        width = config.intermediate_size if tp is None else TPLayout.of(config, tp.rank, tp.size).intermediate
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, bias, kernels)
        self.down_proj = Linear(width, config.hidden_size, bias and (tp is None or tp.rank == 0), kernels)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP output, plus `residual` when given (added inside down_proj's matrix product on CUDA)."""
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.tp is None:
            return self.down_proj(self.kernels.silu_mul(gate_up), residual)
        return _row_parallel(self.down_proj, self.kernels.silu_mul(gate_up), residual, self.tp)

    def load(self, weights: Mapping[str, torch.Tensor | CompressedWeight], layer_prefix: str,
             scratch: ExpandScratch | None) -> None:
        gate_up = [f"{layer_prefix}.mlp.{p}_proj" for p in ("gate", "up")]
        self.gate_up_proj.load([weights[f"{n}.weight"] for n in gate_up],
                               _maybe(weights, [f"{n}.bias" for n in gate_up]), scratch)
        self.down_proj.load([weights[f"{layer_prefix}.mlp.down_proj.weight"]],
                            _maybe(weights, [f"{layer_prefix}.mlp.down_proj.bias"]), scratch)


def llama_mlp(config: ModelConfig, layer: int, kernels: LayerKernels, tp: TensorParallel | None) -> nn.Module:
    return LlamaMLP(config, kernels, tp)


def _row_parallel(proj: Linear, x: torch.Tensor, residual: torch.Tensor | None, tp: TensorParallel) -> torch.Tensor:
    """proj(x) (+ residual) over a group: the ranks' partial products summed by one all-reduce, the residual
    (replicated on every rank) added by rank 0 alone, inside its product as on one rank."""
    return tp.all_reduce(proj(x, residual if tp.rank == 0 else None))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 kernels: LayerKernels, mlp: MLPFactory = llama_mlp, tp: TensorParallel | None = None,
                 cache_index: int | None = None) -> None:
        """`layer`: its index in the model; `cache_index`: its KV cache's among the runner's (`layer` unless a
        pipeline stage holds it). `tp`: this rank's shard of the layer (its heads; its part of the MLP, which
        `mlp` builds)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = LlamaAttention(config, layer if cache_index is None else cache_index, qkv_bias, o_bias,
                                        qk_norm, kernels, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = mlp(config, layer, kernels, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), cos, sin, attn, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """With kernels that add the residual inside the norm (residual_in_norm: CUDA with the Triton kernels):
        x is the previous layer's MLP output, not yet added to `residual`
        (None before the first layer); each add rides in the norm after it. Returns (MLP output, residual)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(self.self_attn(h, cos, sin, attn), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Token ids + positions in, hidden states out; `compute_logits` only for the rows that need them
    (backends.models.base.CausalLM)."""

    def __init__(self, config: ModelConfig, kernels: LayerKernels, *, qkv_bias: bool | None = None,
                 o_bias: bool | None = None, qk_norm: bool = False, mlp: MLPFactory = llama_mlp,
                 tp: TensorParallel | None = None, stage: PipelineStage | None = None) -> None:
        """`mlp` builds each layer's feed-forward block (the MoE families pass theirs). `tp`: build this rank's
        shard (backends/models/tensor_parallel.py): its heads, MLP columns and vocabulary rows. `stage`: build
        only a pipeline stage's layers (backends/models/pipeline.py), with the embedding and LM head on the
        first stage alone."""
        super().__init__()
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        o_bias = attention_bias if o_bias is None else o_bias
        self.config = config
        self.kernels = kernels
        self.tp = tp
        self.tp_layout = None if tp is None else TPLayout.of(config, tp.rank, tp.size)
        self.stage = stage
        held = PipelineStage.layers_of(stage, config.num_hidden_layers)
        self.first_layer = held.start
        vocab_rows = config.vocab_size if self.tp_layout is None else self.tp_layout.vocab
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: LMHead | None = None
        if stage is None or stage.is_first:
            self.embed_tokens, self.lm_head = embedding_and_head(config, kernels, vocab_rows)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, o_bias, qk_norm, kernels, mlp, tp, cache_index=i - self.first_layer)
            for i in held)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round it. Built on the CPU (the model
        # may be constructed on the meta device) and moved to the device of the first positions it sees.
        with torch.device("cpu"):
            self.inv_freq = rope_inv_freq(config, self.decoder_layer(0).self_attn.head_dim)

    def decoder_layer(self, index: int) -> LlamaDecoderLayer:
        layer = self.layers[index]
        assert isinstance(layer, LlamaDecoderLayer)   # nn.ModuleList hands out untyped Modules
        return layer

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of `positions` (the kernels' rotary_tables)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return self.kernels.rotary_tables(self.inv_freq, positions, self.norm.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """[num_tokens, hidden] final-normed hidden states; writes every token's K/V into the cache. A pipeline
        stage after the first starts from `hidden` (the previous stage's output) instead of the embeddings, and
        one before the last returns its layers' residual stream, not normed."""
        cos, sin = self.rotary(positions)
        x = self.embed(input_ids) if hidden is None else hidden
        last = self.stage is None or self.stage.is_last
        if self.kernels.residual_in_norm:
            residual: torch.Tensor | None = None
            for index in range(len(self.layers)):
                x, residual = self.decoder_layer(index).forward_fused(x, residual, cos, sin, attn)
            if last:
                return self.norm.add_norm(x, residual)[0]
            return x if residual is None else x + residual
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x) if last else x

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
        """Copy HF-named tensors in, fusing q/k/v (and each MLP its own); every parameter must be covered.
        `keep_compressed`: the decoder layers' projections given compressed stay compressed, expanded
        just before each runs (the embedding, norms and LM head are expanded once)."""
        scratch = ExpandScratch() if keep_compressed else None
        for i in range(len(self.layers)):
            prefix, layer = f"model.layers.{self.first_layer + i}", self.decoder_layer(i)
            attn = layer.self_attn
            qkv = [f"{prefix}.self_attn.{p}_proj" for p in "qkv"]
            attn.qkv_proj.load([weights[f"{n}.weight"] for n in qkv], _maybe(weights, [f"{n}.bias" for n in qkv]),
                               scratch)
            attn.o_proj.load([weights[f"{prefix}.self_attn.o_proj.weight"]],
                             _maybe(weights, [f"{prefix}.self_attn.o_proj.bias"]), scratch)
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.q_norm.weight.copy_(dense(weights[f"{prefix}.self_attn.q_norm.weight"]))
                attn.k_norm.weight.copy_(dense(weights[f"{prefix}.self_attn.k_norm.weight"]))
            cast(DecoderMLP, layer.mlp).load(weights, prefix, scratch)
            layer.input_layernorm.weight.copy_(dense(weights[f"{prefix}.input_layernorm.weight"]))
            layer.post_attention_layernorm.weight.copy_(dense(weights[f"{prefix}.post_attention_layernorm.weight"]))
        self.norm.weight.copy_(dense(weights["model.norm.weight"]))
        if self.embed_tokens is None or self.lm_head is None:   # a later pipeline stage
            return
        embed = self._vocab_rows(dense(weights["model.embed_tokens.weight"]))
        self.embed_tokens.weight.copy_(embed)
        tied = getattr(self.config, "tie_word_embeddings", False)  # then a stored lm_head.weight is ignored
        self.lm_head.load(embed if tied else self._vocab_rows(dense(weights["lm_head.weight"])))

    def _vocab_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A rank's vocabulary rows padded with zeros to its share (the last rank's may run past the vocabulary)."""
        missing = on_first_stage(self.embed_tokens).weight.shape[0] - rows.shape[0]
        return rows if missing <= 0 else torch.cat((rows, rows.new_zeros(missing, rows.shape[1])))


def _maybe(weights: Mapping[str, torch.Tensor | CompressedWeight], names: list[str]) -> list[torch.Tensor] | None:
    return [dense(weights[n]) for n in names] if all(n in weights for n in names) else None
