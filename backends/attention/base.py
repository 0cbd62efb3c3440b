"""The one interface every attention backend implements, the per-step layout they share, and the backend factory.

A backend turns a `StepLayout` into its own metadata once per step, then per layer writes the new
K/V into the paged cache and attends. Backends never decide what runs; models never see which backend runs.
"""
from __future__ import annotations

import importlib
import importlib.util
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from backends.core.registered import Registered

# What a backend's `prepare` builds once per step and its `attend` reads in every layer.
MetadataT = TypeVar("MetadataT")


class AttentionBackendName(Registered):
    """The attention backends (the CLI's `--attention-backend` choices), each with where its class lives
    ("module:class", imported when chosen): the enum is the registry, and adding a backend is one file in
    backends/attention/ and one member here."""
    SDPA = "sdpa", "backends.attention.sdpa:SDPABackend"                      # torch SDPA: the CPU path, the reference
    FLASH = "flash", "backends.attention.flash:FlashAttentionBackend"         # flash_attn varlen prefill, paged decode
    TRITON = "triton", "backends.attention.triton_decode:TritonDecodeBackend"  # Triton paged decode, SDPA for prefill


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int       # query heads
    num_kv_heads: int    # KV heads (num_heads % num_kv_heads == 0)
    head_dim: int        # channels per head
    block_size: int      # tokens per KV block
    scale: float         # softmax scale, usually head_dim ** -0.5
    dtype: torch.dtype   # element type of queries and of the KV cache
    # Set: latent attention (backends.models.base.LayerKVSpec): queries of 2 * head_dim channels read one
    # cached vector per token, split over the K and V caches; the output has latent_value_dim channels.
    latent_value_dim: int | None = None

    @property
    def query_dim(self) -> int:
        return self.head_dim if self.latent_value_dim is None else 2 * self.head_dim

    @property
    def out_dim(self) -> int:
        return self.head_dim if self.latent_value_dim is None else self.latent_value_dim


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each chunk's tokens sit in one step, built once by the runner and shared by all layers."""
    query_lens: tuple[int, ...]     # new tokens per chunk (host)
    context_lens: tuple[int, ...]   # tokens already cached before them, per chunk (host)
    block_tables: tuple[tuple[int, ...], ...]  # per chunk, the blocks covering context + new tokens (host)
    slot_mapping: torch.Tensor      # [num_tokens] int64: cache slot (block * block_size + offset) per new token
    device: torch.device            # where the model (and cache) runs

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens, strict=True))

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each chunk's first token sits among the step's tokens."""
        return tuple(itertools.accumulate(self.query_lens[:-1], initial=0)) if self.query_lens else ()


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A step's decodes as a paged kernel (Triton's, the CPU's) reads them: one-token chunks, and for the CPU
    kernel also short chunks (speculative tokens to verify); built once per step, read by every layer."""
    token_index: torch.Tensor   # [tokens] int64: step token of each query row, chunk after chunk
    block_tables: torch.Tensor  # [n, max_blocks] int32, padded with block 0 (never read past seq_lens)
    seq_lens: torch.Tensor      # [n] int32 (int64 from a CUDA graph's inputs): keys to attend, context + new tokens
    in_order: bool              # the rows are the step's every token, in order (no gather or scatter)
    query_starts: torch.Tensor | None = None  # [n + 1] int64: chunk i's rows; None: one row per chunk


def decode_rows(layout: StepLayout, chunks: Sequence[int], starts: Sequence[int], block_size: int) -> DecodeRows:
    """The rows for `chunks` of `layout` (whose chunks start at `starts`): one per new token."""
    q_lens = [layout.query_lens[i] for i in chunks]
    lens = [layout.context_lens[i] + q for i, q in zip(chunks, q_lens, strict=True)]
    max_blocks = max(-(-n // block_size) for n in lens)
    tables = [list(layout.block_tables[i][:max_blocks]) for i in chunks]
    dev = layout.device
    tokens = [starts[i] + j for i, q in zip(chunks, q_lens, strict=True) for j in range(q)]
    query_starts = None
    if any(q != 1 for q in q_lens):
        query_starts = torch.tensor(list(itertools.accumulate(q_lens, initial=0)), dtype=torch.long, device=dev)
    return DecodeRows(
        token_index=torch.tensor(tokens, dtype=torch.long, device=dev),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        in_order=len(chunks) == len(layout.query_lens), query_starts=query_starts)


class AttentionBackend(ABC, Generic[MetadataT]):
    """Attention over a paged KV cache; subclasses differ only in kernels."""

    name: AttentionBackendName

    def __init__(self, shape: AttentionShape, device: torch.device | None = None) -> None:
        """`device`: where the backend will run, when known (it may load kernels for it now, not in a step)."""
        self.shape = shape

    @abstractmethod
    def prepare(self, layout: StepLayout) -> MetadataT:
        """Backend-specific index tensors for one step (built once, reused by every layer)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: MetadataT) -> torch.Tensor:
        """[num_tokens, num_heads, shape.out_dim] output for q [num_tokens, num_heads, shape.query_dim]; the new
        K/V are already cached."""

    def static_decode_metadata(self, rows: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor) -> MetadataT | None:
        """Metadata for a decode-only step (token i of the step is sequence i's one new token) read from
        fixed tensors that a CUDA graph replays: `block_tables` [n, width] int32, `seq_lens` [n] with the
        new token counted, `rows` [n] = 0..n-1. None: this backend's decode cannot be captured."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                metadata: MetadataT) -> torch.Tensor:
        """Write this step's k/v ([num_tokens, num_kv_heads, head_dim]) at their slots, then attend."""
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return self.attend(q, k_cache, v_cache, metadata)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """One scatter per tensor: cache viewed as [num_blocks * block_size, num_kv_heads, head_dim]."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


@dataclass(frozen=True, slots=True)
class AttentionContext:
    """What a model's attention layers need in one step: the backend, its metadata, the cache tensors."""
    backend: AttentionBackend[Any]
    metadata: object                    # from backend.prepare
    slot_mapping: torch.Tensor          # [num_tokens] int64, same as the layout's
    k_caches: list[torch.Tensor]        # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]        # per layer, same shape

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_caches[layer], self.v_caches[layer],
                                    self.slot_mapping, self.metadata)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q over the cache, this step's K/V already written there by the caller."""
        return self.backend.attend(q, self.k_caches[layer], self.v_caches[layer], self.metadata)


_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def default_backend_name(device: torch.device, dtype: torch.dtype,
                         latent: bool = False) -> AttentionBackendName:
    """flash when flash_attn is importable on CUDA (fp16/bf16), else Triton decode on CUDA, else SDPA. A latent
    cache gets SDPA: flash reads K and V heads, and the Triton latent kernel (triton_mla.py), checked only under
    Triton's interpreter so far, is `--attention-backend triton` until it has run on a GPU (docs/gpu.md)."""
    if device.type != "cuda" or latent:
        return AttentionBackendName.SDPA
    if dtype in _FLASH_DTYPES and importlib.util.find_spec("flash_attn") is not None:
        return AttentionBackendName.FLASH
    if importlib.util.find_spec("triton") is not None:
        return AttentionBackendName.TRITON
    return AttentionBackendName.SDPA


def create_backend(name: AttentionBackendName | str | None, shape: AttentionShape,
                   device: torch.device) -> AttentionBackend[Any]:
    """The named backend (or the default for `device`); a GPU backend on a CPU device is an error. Latent
    attention runs on SDPA or on Triton (its own decode kernel), not on flash_attn (which reads K and V heads)."""
    latent = shape.latent_value_dim is not None
    chosen = default_backend_name(device, shape.dtype, latent) if name is None else AttentionBackendName(name)
    if latent and chosen is AttentionBackendName.FLASH:
        raise ValueError(f"attention backend {chosen.value!r} does not read a latent KV cache: use sdpa or triton")
    if chosen is not AttentionBackendName.SDPA and device.type != "cuda":
        raise ValueError(f"attention backend {chosen.value!r} needs a CUDA device, got {device}")
    if chosen is AttentionBackendName.FLASH and shape.dtype not in _FLASH_DTYPES:
        raise ValueError(f"flash_attn needs float16 or bfloat16, got {shape.dtype}")
    module_name, class_name = chosen.target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(shape, device)
