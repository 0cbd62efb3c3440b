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
# The kernel's stack buffers (paged_decode.cpp, kMax*): a shape beyond them decodes with SDPA.
_MAX_GROUP, _MAX_HEAD_DIM = 16, 256

# q [n, heads, head_dim], k/v cache, block_tables [n, max_blocks], seq_lens [n], scale -> [n, heads, head_dim]
PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def supports(shape: AttentionShape) -> bool:
    """Whether the kernel handles this attention shape (else its decodes stay with SDPA)."""
    group = shape.num_heads // shape.num_kv_heads
    return shape.dtype in _DTYPES and group <= _MAX_GROUP and shape.head_dim <= _MAX_HEAD_DIM


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
