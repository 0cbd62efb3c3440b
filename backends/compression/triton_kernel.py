"""The Triton kernel behind CompressedTensor.decompress on CUDA (resident.py): one program per lane.

Imported only when a tensor is expanded, so that importing the compression package never imports Triton.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_lanes_kernel(codes_ptr, lane_start_ptr, payload_ptr, lengths_ptr, raw_ptr, out_ptr,
                        numel, LANE: tl.constexpr, WORD: tl.constexpr, IS_BF16: tl.constexpr):
    lane = tl.program_id(0)
    c0 = tl.load(lane_start_ptr + lane)
    c1 = tl.load(lane_start_ptr + lane + 1)
    idx = tl.arange(0, LANE)
    live = idx < (c1 - c0)
    code = tl.load(codes_ptr + c0 + idx, mask=live, other=0).to(tl.int32) & 0xFFFF
    length = tl.load(lengths_ptr + code, mask=live, other=0).to(tl.int32)
    payload = tl.load(payload_ptr + code, mask=live, other=0)                 # int64: 8 symbols
    start = lane.to(tl.int64) * LANE + (tl.cumsum(length, 0) - length)       # first element of each word
    for j in tl.static_range(WORD):
        ok = live & (length > j)
        sym = ((payload >> (8 * j)) & 0xFF).to(tl.int32)
        at = start + j
        ok = ok & (at < numel)
        raw = tl.load(raw_ptr + at, mask=ok, other=0).to(tl.int32)
        if IS_BF16:  # noqa: SIM108 - an `if` on a constexpr: Triton compiles only the branch taken
            bits = ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
        else:
            bits = (sym << 8) | raw
        tl.store(out_ptr + at, bits.to(tl.int16), mask=ok)
