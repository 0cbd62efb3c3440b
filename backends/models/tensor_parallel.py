"""Tensor parallelism as the models see it: the group's collectives (`TensorParallel`, a protocol the executor
implements over torch.distributed), how a Llama-family checkpoint splits over the ranks (`TPLayout`), and the
check that refuses a size the model's heads do not divide.

Megatron's split, as vLLM's ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding do it: q/k/v and
gate/up are split by output rows (column-parallel: no communication), o_proj and down_proj by input columns
(row-parallel: one all-reduce each), the embedding and the LM head by vocabulary rows. Nothing here talks to
another process; the model calls `all_reduce` and `gather_vocab` and the executor does the talking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from backends.models.model_config import ModelConfig


class TensorParallel(Protocol):
    """A rank's view of its tensor-parallel group."""
    rank: int   # this process's rank, 0..size-1 (rank 0 samples)
    size: int   # ranks in the group (> 1: a single rank runs with no TensorParallel at all)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        ...

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Rank 0: each rank's [rows, vocab_per_rank] logits side by side ([rows, size * vocab_per_rank]);
        other ranks: `local`, unchanged (only rank 0 samples)."""
        ...

    def agree_min(self, value: int) -> int:
        """The smallest `value` any rank holds (every rank gets it): sizes the ranks must share."""
        ...


def _divide(what: str, count: int, size: int) -> int:
    if count % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {count} {what}; "
                         f"choose a size that divides {count}")
    return count // size


@dataclass(frozen=True, slots=True)
class TPLayout:
    """What rank `rank` of `size` holds of a Llama-family model: contiguous ranges of heads, MLP columns and
    vocabulary rows. With fewer KV heads than ranks, each KV head is replicated on size // num_kv_heads ranks."""
    rank: int                 # this rank
    size: int                 # ranks in the group
    num_heads: int            # query heads on this rank
    num_kv_heads: int         # KV heads on this rank (1 where they are replicated)
    head_dim: int             # channels per head
    first_head: int           # this rank's first query head
    first_kv_head: int        # this rank's first KV head
    intermediate: int         # MLP columns on this rank
    vocab: int                # vocabulary rows on this rank (the last rank's may run past the real vocabulary)

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> TPLayout:
        """The layout, or ValueError naming what `size` does not divide."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        local_heads = _divide("attention heads", heads, size)
        if kv_heads >= size:
            local_kv = _divide("KV heads", kv_heads, size)
            first_kv = rank * local_kv
        else:   # fewer KV heads than ranks: each rank keeps the one its query heads read
            if size % kv_heads:
                raise ValueError(f"--tensor-parallel-size {size} neither divides the model's {kv_heads} KV heads "
                                 f"nor is a multiple of them")
            local_kv, first_kv = 1, rank * kv_heads // size
        intermediate = _divide("MLP columns (intermediate_size)", int(config.intermediate_size), size)
        vocab = -(-int(config.vocab_size) // size)
        return cls(rank=rank, size=size, num_heads=local_heads, num_kv_heads=local_kv, head_dim=head_dim,
                   first_head=rank * local_heads, first_kv_head=first_kv, intermediate=intermediate, vocab=vocab)

    @property
    def first_vocab(self) -> int:
        return self.rank * self.vocab

    def rows_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` that this rank reads, or None: the whole tensor
        (norms, a row-parallel bias: replicated). `stop` may run past a vocabulary's end (read to the end)."""
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        is_bias = name.endswith(".bias")
        heads = {"q_proj": (self.first_head, self.num_heads), "k_proj": (self.first_kv_head, self.num_kv_heads),
                 "v_proj": (self.first_kv_head, self.num_kv_heads)}
        if part in heads:
            first, count = heads[part]
            return 0, first * self.head_dim, (first + count) * self.head_dim
        if part in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        if is_bias:   # o_proj / down_proj: added once, by rank 0 (RowParallel.bias_owner)
            return None
        if part == "o_proj":
            return 1, self.first_head * self.head_dim, (self.first_head + self.num_heads) * self.head_dim
        if part == "down_proj":
            return 1, self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.first_vocab, self.first_vocab + self.vocab
        return None


def vocab_parallel_embed(weight: torch.Tensor, input_ids: torch.Tensor, layout: TPLayout,
                         tp: TensorParallel) -> torch.Tensor:
    """The embeddings [num_tokens, hidden] of input_ids from each rank's rows of the table [vocab_per_rank,
    hidden]: a rank looks up the ids it holds, zeros the others, and the all-reduce sums the rows."""
    local = input_ids - layout.first_vocab
    outside = (local < 0) | (local >= layout.vocab)
    rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0.0))
