"""The CPU paged-decode kernel (backends/cpu_kernels/paged_decode.cpp) as the SDPA backend uses it.

It says which shapes the kernel takes and hands out the loaded operator; the build belongs to
backends.cpu_kernels, the per-step decode rows it reads to base.DecodeRows, and which chunks run where to
the SDPA backend. Set SWITCHYARD_CPU_PAGED_ATTENTION=0 to turn it off (decodes go back to gather + SDPA).
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from backends import cpu_kernels
from backends.attention.base import AttentionShape

log = logging.getLogger(__name__)

ENV_SWITCH = "SWITCHYARD_CPU_PAGED_ATTENTION"
_DTYPES = (torch.float32, torch.bfloat16)
# The kernel's stack buffers (paged_decode.cpp, kMax*): query rows per work item (a chunk's tokens times the query
# heads of one KV head), those rows times head_dim, and head_dim. A shape beyond them attends with SDPA.
_MAX_ROWS, _MAX_ROW_ELEMS, _MAX_HEAD_DIM = 64, 4096, 256
# The longest chunk the kernel takes: a speculative verify (K + 1 tokens) is one. Longer chunks are prefills,
# where SDPA's blocked matrix products win.
MAX_CHUNK = 16

# q [tokens, heads, head_dim], k/v cache, block_tables [n, max_blocks], seq_lens [n], query_starts [n + 1] or None
# (one token per sequence), scale -> [tokens, heads, head_dim]
PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                        float], torch.Tensor]


def max_chunk(shape: AttentionShape) -> int:
    """The longest chunk (new tokens of one sequence) the kernel attends for this shape; 0: none (a shape or
    dtype it does not handle: those decodes stay with SDPA)."""
    group = shape.num_heads // shape.num_kv_heads
    if shape.dtype not in _DTYPES or shape.head_dim > _MAX_HEAD_DIM or shape.latent_value_dim is not None:
        return 0
    return min(MAX_CHUNK, _MAX_ROWS // group, _MAX_ROW_ELEMS // (group * shape.head_dim))


@functools.cache
def load_paged_decode() -> PagedDecode | None:
    """The kernel, or None when it is switched off or the CPU kernels could not be built: the caller then
    falls back to gather + SDPA."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("CPU paged decode attention off (%s=0): decodes gather blocks for SDPA", ENV_SWITCH)
        return None
    if not cpu_kernels.load():
        return None
    op: PagedDecode = torch.ops.switchyard_cpu.paged_decode
    return op
