"""What the Triton paged-decode kernels share when a sequence's keys are split across programs
(flash-decoding): the split cap, the programs a device wants, and the kernel that merges the splits' partial
softmaxes. The dense kernel (triton_decode.py) and the latent one (triton_mla.py) both write its layout.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16


@triton.jit(do_not_specialize=["splits"])
def merge_splits_kernel(part_ptr, stats_ptr, out_ptr, splits, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """out[seq, head] from partials [n, NUM_HEADS, splits, DIM_PAD] and stats [n, NUM_HEADS, splits, 2]
    (max, sum), float32; one program per (seq, head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_ok = s < splits
    row = (seq * NUM_HEADS + head) * splits + s
    m = tl.load(stats_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(stats_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)   # finite: split 0 holds the sequence's first token
    w = tl.where(s_ok, tl.exp(m - m_max), 0.0)
    part = tl.load(part_ptr + row[:, None] * DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w * l_s, axis=0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def programs_wanted(device: torch.device) -> int:
    """Programs that keep every multiprocessor busy: two per SM on CUDA; a few under Triton's interpreter."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count
