"""Triton kernels for the decoder's small elementwise steps on CUDA: one launch where torch takes several.

A decode step of a small model on a GPU is hundreds of tiny kernels at about 3 us each (docs/gpu.md), so
a layer's kernel count is its floor. Per layer these take:
- rotary on q and k, the cache writes of k and v, and q's copy out of the fused qkv projection: one
  kernel (`rotary_store`) where torch took five (three for the rotary, one index_copy_ each for k and v);
- SiLU(gate) * up: one kernel (`silu_mul`) where torch took two;
- the residual add and the RMSNorm after it: one kernel (`add_rms_norm`) where torch took a copy (the
  residual into the output of an `addmm`) and a norm kernel that took 6 us for one row of 4,096.
All compute in float32 and round once to the model's dtype (torch rounds after each op).

And one for a projection of one row (`gemv`, a decode step of one sequence): cuBLAS's kernel for some
shapes leaves half the multiprocessors idle (the 8B shape's o_proj, 4,096 x 4,096, ran at 1.6 TB/s where
its other projections ran at 2.9). Which is faster is measured per weight shape when the model is loaded
(`tune_linears`), and cuBLAS keeps every shape where it wins.

Imported only on CUDA (Triton is not a dependency of the CPU worker); the layers reach these through
backends/models/kernels/triton.py. `ENABLED` turns them off, for a benchmark's same-run baseline; it is read
when a model is built (kernels/registry.py, select_cuda), so a CUDA graph keeps what it captured.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from backends.models.kernels.base import GemvConfig, ModuleTree, gemv_projections

log = logging.getLogger(__name__)

ENABLED = os.environ.get("SWITCHYARD_CUDA_FUSED", "1") != "0"


@triton.jit
def _rotary_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_xt, stride_ct, stride_st, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)   # q heads, then k heads, then v heads, as the fused projection lays them out
    d = tl.arange(0, DIM_PAD)
    ok = d < HEAD_DIM
    row = qkv_ptr + token * stride_xt + head * HEAD_DIM
    x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
    if head < HEADS + KV_HEADS:
        half = HEAD_DIM // 2
        partner = tl.where(d < half, d + half, d - half)
        x_partner = tl.load(row + partner, mask=ok, other=0.0).to(tl.float32)
        # the full-width tables: cos|cos and -sin|sin (layers.rotary_tables)
        cos = tl.load(cos_ptr + token * stride_ct + d, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_st + d, mask=ok, other=0.0).to(tl.float32)
        y = x * cos + x_partner * sin
        if head < HEADS:
            tl.store(q_out_ptr + token * stride_qt + head * stride_qh + d, y.to(q_out_ptr.dtype.element_ty), mask=ok)
        else:
            slot = tl.load(slots_ptr + token).to(tl.int64)
            at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + (head - HEADS) * stride_kh
            tl.store(k_cache_ptr + at + d, y.to(k_cache_ptr.dtype.element_ty), mask=ok)
    else:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        at = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt + (head - HEADS - KV_HEADS) * stride_vh
        tl.store(v_cache_ptr + at + d, x.to(v_cache_ptr.dtype.element_ty), mask=ok)


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """From qkv [num_tokens, (heads + 2 * kv_heads) * head_dim]: the rotated q [num_tokens, heads, head_dim]
    (a new tensor); the rotated k and the v written into the caches ([num_blocks, block_size, kv_heads,
    head_dim]) at `slot_mapping`. cos, sin: the full-width tables [num_tokens, 1, head_dim]."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (heads + 2 * kv_heads)
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    q = torch.empty((num_tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    _rotary_store_kernel[(num_tokens, heads + 2 * kv_heads)](
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1])
    return q


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < WIDTH
    gate = tl.load(x_ptr + token * stride_xt + j, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + WIDTH + j, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + token * stride_ot + j, y.to(out_ptr.dtype.element_ty), mask=ok)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [num_tokens, 2 * width], the gate half first."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs a 2-D gate_up with a contiguous last dimension")
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        _silu_mul_kernel[(num_tokens, triton.cdiv(width, SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width, BLOCK=SILU_BLOCK)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_xt, stride_rt, stride_ot, eps,
                     WIDTH: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    token = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    ok = j < WIDTH
    x = tl.load(x_ptr + token * stride_xt + j, mask=ok, other=0.0)
    if ADD:
        # the sum, rounded to the dtype as it is kept, written over x: the next residual
        x = (x.to(tl.float32) + tl.load(residual_ptr + token * stride_rt + j, mask=ok, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + token * stride_xt + j, x, mask=ok)
    x = x.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / WIDTH + eps)
    w = tl.load(weight_ptr + j, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + j, (x * scale * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x, residual [num_tokens, width]: the sum is written over x,
    which the caller must own (a sublayer's fresh output). Without a residual: (RMSNorm(x), x)."""
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm needs 2-D tensors with a contiguous last dimension")
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, x if residual is None else residual, weight, out, x.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0), eps,
            WIDTH=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), ADD=residual is not None,
            num_warps=max(1, min(16, triton.next_power_of_2(x.shape[1]) // 256)))
    return out, x


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, n_rows, k_cols, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < n_rows
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, k_cols, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < k_cols
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=r_ok)


# (rows per program, columns per loop step, warps): each step of a program reads 16 KB of the weight
GEMV_CONFIGS: tuple[tuple[int, int, int], ...] = ((2, 4096, 8), (4, 2048, 8), (8, 1024, 8), (16, 512, 8))


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """x [1, in] times weight [out, in] transposed: [1, out], in float32, rounded once to x's dtype."""
    if x.shape[0] != 1 or x.stride(-1) != 1 or weight.stride(1) != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError("gemv takes one contiguous row and an [out, in] weight")
    rows, cols, warps = config
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(weight.shape[0], rows),)](x, weight, out, weight.shape[0], weight.shape[1],
                                                        weight.stride(0), BLOCK_N=rows, BLOCK_K=cols, num_warps=warps)
    return out


def graph_seconds(fn: Callable[[], object], calls: int = 20, replays: int = 7) -> float:
    """Median GPU seconds of one fn() from replays of a CUDA graph of `calls` calls (no launch overhead)."""
    fn()   # compiles a Triton kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def pick_gemv(weight: torch.Tensor) -> GemvConfig | None:
    """The fastest way to project one row through `weight` on its GPU, measured: a GEMV_CONFIGS entry, or
    None where cuBLAS (F.linear) is at least as fast."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    timings: dict[GemvConfig | None, float] = {None: graph_seconds(lambda: F.linear(x, weight))}
    for config in GEMV_CONFIGS:
        timings[config] = graph_seconds(functools.partial(gemv, x, weight, config))
    best = min(timings, key=lambda c: timings[c])
    log.info("one-row projection through [%d, %d] %s: %s (%.1f us; cuBLAS %.1f us)", *weight.shape, weight.dtype,
             "cuBLAS" if best is None else f"Triton gemv {best}", timings[best] * 1e6, timings[None] * 1e6)
    return best


def tune_linears(model: ModuleTree, pick: Callable[[torch.Tensor], GemvConfig | None] | None = None) -> None:
    """Give every plain CUDA projection of `model` (layers.Linear: [out, in] weight, no bias, not packed or
    kept compressed) the one-row kernel `pick` (by default pick_gemv, looked up when called) measures fastest
    for its shape; one measurement per shape."""
    pick = pick or pick_gemv

    chosen: dict[tuple[tuple[int, ...], torch.dtype], GemvConfig | None] = {}
    for module in gemv_projections(model):
        key = (tuple(module.weight.shape), module.weight.dtype)
        if key not in chosen:
            try:
                chosen[key] = pick(module.weight)
            except Exception:   # a kernel that fails to build or run here: cuBLAS, as before
                log.warning("no Triton gemv for %s: cuBLAS kept", key, exc_info=True)
                chosen[key] = None
        module.gemv_config = chosen[key]
