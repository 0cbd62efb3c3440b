"""The embedding table and LM head a draft head reads: the target's own, or, beside a tensor-parallel shard (whose
tables hold only its rank's vocabulary rows, and answer through collectives the other ranks do not join while rank 0
drafts), whole copies read from the checkpoint for rank 0 alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from backends.models.kernels.base import LayerKernels
from backends.models.layers import embedding_and_head
from backends.models.model_config import ModelConfig
from backends.worker.shard_loader import ShardReader


class Vocabulary(Protocol):
    """What a draft head reads of its target (a CausalLM is one)."""

    config: ModelConfig

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] input embeddings of input_ids [num_tokens]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits of final hidden states [rows, hidden]."""
        ...

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's [vocab, hidden] weight."""
        ...


class WholeVocabulary(nn.Module):
    """Every vocabulary row of the target's embedding and LM head, on one rank (one tensor when the config ties
    them): vocabulary x hidden x dtype bytes, twice when untied, beyond what the rank's shard holds."""

    def __init__(self, config: ModelConfig, kernels: LayerKernels) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens, self.lm_head = embedding_and_head(config, kernels, int(config.vocab_size))
        self._packed = False

    @classmethod
    def read(cls, model_dir: Path, config: ModelConfig, kernels: LayerKernels, dtype: torch.dtype,
             device: torch.device) -> WholeVocabulary:
        """The two tables of the checkpoint in `model_dir`, read whole (and only them) out of its mapped files."""
        vocabulary = cls(config, kernels).to(device=device, dtype=dtype)
        tied = bool(getattr(config, "tie_word_embeddings", False))   # then a stored lm_head.weight is ignored
        with ShardReader(model_dir, None) as weights, torch.no_grad():
            vocabulary.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
            if not tied:
                vocabulary.lm_head.weight.copy_(weights["lm_head.weight"])
        return vocabulary.eval()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._packed:   # packed at first use: a head that drafts in int8 or among a subset never asks
            weight = self.lm_head.weight
            self.lm_head.packed = self.lm_head.kernels.pack(weight, weight.dtype)
            self._packed = True
        return self.lm_head(hidden)

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def weight_bytes(self) -> int:
        """Bytes it adds to its rank: the tables and, once it has computed logits, the kernels' packed copy of
        the head (a tied table counted once)."""
        tensors = {id(t): t for t in (self.embed_tokens.weight, self.lm_head.weight, self.lm_head.packed)
                   if t is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())
