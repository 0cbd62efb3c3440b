"""What the worker asks of a model: the `CausalLM` protocol and the per-layer KV cache shape a model declares.

The runner, the CUDA graphs and the speculative proposers hold a model through this interface only; a model
file (one per architecture, registered in backends/models/__init__.py) implements it however it is built.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import torch
from torch import nn

from backends.attention.base import AttentionContext
from backends.models.model_config import ModelConfig

if TYPE_CHECKING:
    from backends.models.kernels.base import LayerKernels
    from backends.models.layers import CompressedWeight
    from backends.models.pipeline import PipelineStage
    from backends.models.tensor_parallel import TensorParallel


@dataclass(frozen=True, slots=True)
class LayerKVSpec:
    """What one decoder layer keeps per token in the paged KV cache, and how its attention reads it."""
    num_heads: int      # query heads
    num_kv_heads: int   # heads of K (and of V) cached per token
    head_dim: int       # channels per cached head
    scale: float        # softmax scale (head_dim ** -0.5 for plain attention)
    # None: separate K and V heads. Set (multi-head latent attention): each token keeps one vector of
    # 2 * head_dim channels (num_kv_heads is 1), its first half in the K cache and its second in the V cache;
    # that vector is every query head's key, and its first latent_value_dim channels every head's value.
    latent_value_dim: int | None = None


@runtime_checkable
class CausalLM(Protocol):
    """A decoder over flat token batches ([num_tokens, ...], no batch dim) and a paged KV cache; an nn.Module."""

    config: ModelConfig

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
        """[num_tokens, hidden] final-normed hidden states of input_ids [num_tokens] at positions [num_tokens];
        writes every token's K/V into attn's caches. A pipeline stage (backends/models/pipeline.py) after the
        first starts from `hidden`, the previous stage's output; one before the last returns its residual
        stream, not normed."""
        ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [num_tokens, hidden] of input_ids [num_tokens] (a draft head reads them)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of final hidden states [rows, hidden], in the model's dtype."""
        ...

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's [vocab, hidden] weight (a draft head builds its own head of a subset of its rows)."""
        ...

    def kv_cache_spec(self) -> tuple[LayerKVSpec, ...]:
        """One entry per layer that keeps a paged KV cache, in the order of attn's caches."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor | CompressedWeight],
                     keep_compressed: bool = False) -> None:
        """Copy a checkpoint's tensors (HF names) in; every parameter must be covered. `keep_compressed`:
        projections given compressed may stay compressed, expanded just before each runs."""
        ...

    def modules(self) -> Iterator[nn.Module]:
        """Its modules (nn.Module's): kernels tune and costs are counted over them."""
        ...

    def eval(self) -> Self:
        ...


class ModelFactory(Protocol):
    """A model class as the registry hands it out: built from a config and the layer kernels for its device."""

    def __call__(self, config: ModelConfig, kernels: LayerKernels) -> CausalLM: ...


class ShardedModelFactory(Protocol):
    """A model class that can build one rank's shard of itself, or one pipeline stage's layers, or both (the
    registry's sharded_model_class)."""

    def __call__(self, config: ModelConfig, kernels: LayerKernels, *, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> CausalLM: ...
