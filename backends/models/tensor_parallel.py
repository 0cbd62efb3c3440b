"""Tensor parallelism as the models see it: the group's collectives (`TensorParallel`, a protocol the executor
implements over torch.distributed), how a Llama-family or DeepSeek-V3 checkpoint splits over the ranks (`TPLayout`,
with `ExpertSplit` for the MoE families' experts and `LatentHeads` for latent attention), and the check that refuses
a size the model does not divide.

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
    expert_parallel: bool   # MoE layers: whole experts split over the ranks, not each expert's columns

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        ...

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Rank 0: each rank's [rows, vocab_per_rank] logits side by side ([rows, size * vocab_per_rank]);
        other ranks: `local`, unchanged (only rank 0 samples)."""
        ...


def _divide(what: str, count: int, size: int, mode: str = "") -> int:
    if count % size:
        raise ValueError(f"--tensor-parallel-size {size} {mode}does not divide the model's {count} {what}; "
                         f"choose a size that divides {count}")
    return count // size


# Per-expert checkpoint tensors by their projection's name (Qwen-MoE's, Mixtral's): gate and up are split by
# output rows, down by input columns, as LlamaMLP's are.
_EXPERT_COLUMN_PARALLEL = frozenset({"gate_proj", "up_proj", "w1", "w3"})
_EXPERT_ROW_PARALLEL = frozenset({"down_proj", "w2"})


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """What rank `rank` holds of a sparse MLP's experts: by default every expert's columns [r*I/N, (r+1)*I/N)
    (within each expert); with expert parallelism, whole experts [r*E/N, (r+1)*E/N). Either way the router is
    replicated and the ranks' outputs are summed by one all-reduce."""
    expert_parallel: bool     # whole experts per rank (True) or a slice of every expert (False)
    first_expert: int         # this rank's first expert
    num_experts: int          # experts on this rank (all of them within each expert)
    first_column: int         # this rank's first column of each expert's width
    intermediate: int         # columns of each expert on this rank

    @classmethod
    def of(cls, num_experts: int, intermediate: int, rank: int, size: int, expert_parallel: bool) -> ExpertSplit:
        """The split, or ValueError naming what `size` does not divide."""
        if expert_parallel:
            local = _divide("experts", num_experts, size, "with --enable-expert-parallel ")
            return cls(True, rank * local, local, 0, intermediate)
        width = _divide("expert columns (moe_intermediate_size)", intermediate, size)
        return cls(False, 0, num_experts, rank * width, width)

    def rows_of(self, projection: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) this rank reads of one expert's `projection` weight; None: all of it (a whole
        expert: with expert parallelism a rank asks for its own experts only)."""
        columns = (self.first_column, self.first_column + self.intermediate)
        if self.expert_parallel:
            return None
        if projection in _EXPERT_COLUMN_PARALLEL:
            return 0, *columns
        if projection in _EXPERT_ROW_PARALLEL:
            return 1, *columns
        raise ValueError(f"no split known for the expert projection {projection!r}")

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed expert ids [T, k] as this rank's indices; another rank's experts become `num_experts` (past the
        last local one: the grouped products skip them)."""
        if not self.expert_parallel:
            return ids
        local = ids - self.first_expert
        return local.masked_fill((local < 0) | (local >= self.num_experts), self.num_experts)


def shared_expert_columns(width: int, size: int) -> int:
    """Columns of a shared expert `width` wide on each of `size` ranks (split as a dense MLP's), or ValueError."""
    return _divide("shared expert columns", width, size)


@dataclass(frozen=True, slots=True)
class LatentHeads:
    """Per-head widths of multi-head latent attention's split tensors (DeepSeek-V3): q_proj / q_b_proj rows, kv_b_proj
    rows (W_UK then W_UV of each head) and o_proj columns. The latent projection (kv_a_proj_with_mqa), q_a_proj
    and their norms are replicated: the latent is every head's key and value."""
    qk_head_dim: int     # qk_nope_head_dim + qk_rope_head_dim
    kv_b_head_dim: int   # qk_nope_head_dim + v_head_dim
    v_head_dim: int      # o_proj's input columns per head

    @classmethod
    def of(cls, config: ModelConfig) -> LatentHeads | None:
        """The widths of a latent-attention config (one with kv_lora_rank); None for any other."""
        if not getattr(config, "kv_lora_rank", None):
            return None
        nope, rope, v = (int(getattr(config, n)) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        return cls(qk_head_dim=nope + rope, kv_b_head_dim=nope + v, v_head_dim=v)


def moe_shape(config: ModelConfig) -> tuple[int, int] | None:
    """(routed experts, columns of each) of a MoE family's config (Mixtral's num_local_experts and
    intermediate_size, Qwen-MoE's num_experts and moe_intermediate_size, DeepSeek's n_routed_experts); None for a
    dense model."""
    num_experts = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
                   or getattr(config, "n_routed_experts", None))
    if not num_experts:
        return None
    return int(num_experts), int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def _has_dense(config: ModelConfig) -> bool:
    """Whether a MoE config keeps dense MLPs in some layers (Qwen-MoE's mlp_only_layers, decoder_sparse_step;
    DeepSeek's first_k_dense_replace)."""
    return (bool(getattr(config, "mlp_only_layers", None)) or int(getattr(config, "decoder_sparse_step", 1) or 1) > 1
            or int(getattr(config, "first_k_dense_replace", 0) or 0) > 0)


def _shared_expert_width(config: ModelConfig) -> int:
    """The (summed) width of a MoE config's shared experts: DeepSeek's n_shared_experts of moe_intermediate_size."""
    return int(getattr(config, "n_shared_experts", 0) or 0) * int(getattr(config, "moe_intermediate_size", 0) or 0)


@dataclass(frozen=True, slots=True)
class TPLayout:
    """What rank `rank` of `size` holds of a Llama-family or DeepSeek-V3 model: contiguous ranges of heads, MLP
    columns and vocabulary rows. With fewer KV heads than ranks, each KV head is replicated on size // num_kv_heads
    ranks; latent attention's one cached latent is replicated on every rank (num_kv_heads 1)."""
    rank: int                 # this rank
    size: int                 # ranks in the group
    num_heads: int            # query heads on this rank
    num_kv_heads: int         # KV heads on this rank (1 where they are replicated)
    head_dim: int             # channels per head
    first_head: int           # this rank's first query head
    first_kv_head: int        # this rank's first KV head
    intermediate: int         # MLP columns on this rank
    vocab: int                # vocabulary rows on this rank (the last rank's may run past the real vocabulary)
    experts: ExpertSplit | None = None   # the sparse MLPs' experts on this rank (None: a dense model)
    shared_intermediate: int = 0         # shared expert columns on this rank (0: none)
    latent: LatentHeads | None = None    # latent attention's per-head widths (None: K/V heads of head_dim)

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> TPLayout:
        """The layout, or ValueError naming what `size` does not divide (or that there are no experts to split
        with `expert_parallel`)."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        local_heads = _divide("attention heads", heads, size)
        latent = LatentHeads.of(config)
        if latent is not None:   # one latent per token, which every rank's heads read
            local_kv, first_kv = 1, 0
        elif kv_heads >= size:
            local_kv = _divide("KV heads", kv_heads, size)
            first_kv = rank * local_kv
        else:   # fewer KV heads than ranks: each rank keeps the one its query heads read
            if size % kv_heads:
                raise ValueError(f"--tensor-parallel-size {size} neither divides the model's {kv_heads} KV heads "
                                 f"nor is a multiple of them")
            local_kv, first_kv = 1, rank * kv_heads // size
        shape = moe_shape(config)
        if expert_parallel and shape is None:
            raise ValueError(f"--enable-expert-parallel: {', '.join(getattr(config, 'architectures', None) or [])} "
                             "has no experts to split; leave the flag out")
        experts = None if shape is None else ExpertSplit.of(*shape, rank, size, expert_parallel)
        dense = int(config.intermediate_size)   # a MoE model's dense MLPs' width: split only if it has any
        intermediate = (_divide("MLP columns (intermediate_size)", dense, size) if shape is None or _has_dense(config)
                        else dense // size)
        vocab = -(-int(config.vocab_size) // size)
        shared = shared_expert_columns(_shared_expert_width(config), size)
        return cls(rank=rank, size=size, num_heads=local_heads, num_kv_heads=local_kv, head_dim=head_dim,
                   first_head=rank * local_heads, first_kv_head=first_kv, intermediate=intermediate, vocab=vocab,
                   experts=experts, shared_intermediate=shared, latent=latent)

    @property
    def first_vocab(self) -> int:
        return self.rank * self.vocab

    def _latent_rows(self, part: str, latent: LatentHeads) -> tuple[int, int, int]:
        """Latent attention's head-split tensors: q (or q_b) and kv_b by output rows, o_proj by input columns."""
        dim, width = {"q_proj": (0, latent.qk_head_dim), "q_b_proj": (0, latent.qk_head_dim),
                      "kv_b_proj": (0, latent.kv_b_head_dim), "o_proj": (1, latent.v_head_dim)}[part]
        return dim, self.first_head * width, (self.first_head + self.num_heads) * width

    def rows_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor `name` that this rank reads, or None: the whole tensor
        (norms, a row-parallel bias: replicated). `stop` may run past a vocabulary's end (read to the end)."""
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        is_bias = name.endswith(".bias")
        if ".experts." in name and self.experts is not None:   # a routed expert's projection
            return self.experts.rows_of(part)
        if ".shared_experts." in name:   # split as a dense MLP, by its own columns
            columns = (self.rank * self.shared_intermediate, (self.rank + 1) * self.shared_intermediate)
            return (0, *columns) if part in ("gate_proj", "up_proj") else (1, *columns)
        if self.latent is not None and part in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj") and not is_bias:
            return self._latent_rows(part, self.latent)
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
