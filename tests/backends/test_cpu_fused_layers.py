"""The fused CPU layer kernels (backends/cpu_kernels/fused_layers.cpp) against transformers' own RMSNorm,
SiLU and rotary, and the CPU kernels' choice between them and the ATen ops.

The model-level check (our forward against transformers' on SmolLM2) is test_model_forward.py, which runs
through these kernels whenever they are built, as `make test` builds them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from backends import cpu_kernels
from backends.models.kernels import cpu
from backends.models.kernels.registry import select_kernels
from backends.models.layers import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]
# float32: a different order of the sum of squares moves the last bits; bfloat16: one unit in the last place.
TOLERANCE = {torch.float32: {"atol": 2e-6, "rtol": 2e-6}, torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """`make test` installs a C++ compiler, so here the kernels must build and be on."""
    assert cpu_kernels.load(), "the CPU kernels did not build (see the warning logged)"
    assert cpu.cpu_fused_layers()


KERNELS = select_kernels("cpu")
silu_mul, rotate = KERNELS.silu_mul, KERNELS.rotate


def strided_rows(rows: int, width: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[rows, width] whose rows sit in a wider buffer (as a slice of a fused projection's output)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + 40, generator=gen) * scale).to(dtype)[:, 7:7 + width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (5, 576), (300, 576), (3, 67), (2, 4096)])
def test_rms_norm_matches_transformers(dtype: torch.dtype, rows: int, width: int) -> None:
    x = strided_rows(rows, width, dtype, seed=rows + width, scale=3.0)
    ours = RMSNorm(width, 1e-5, KERNELS).to(dtype)
    theirs = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    weight = torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.5
    ours.weight.copy_(weight)
    theirs.weight.data.copy_(weight)
    with torch.inference_mode(), torch.profiler.profile() as prof:
        got = ours(x)
    assert any(e.key == "switchyard_cpu::rms_norm" for e in prof.key_averages())
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, theirs(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 576), (300, 576), (3, 67)])
def test_add_rms_norm_matches_the_add_then_transformers_norm(dtype: torch.dtype, rows: int, width: int) -> None:
    """The residual add written over x exactly as ATen's add rounds it; the norm of that sum as transformers'."""
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    residual = strided_rows(rows, width, dtype, seed=rows + 1, scale=3.0)
    residual_before = residual.clone()
    ours = RMSNorm(width, 1e-5, KERNELS).to(dtype)
    theirs = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    weight = torch.rand(width, generator=torch.Generator().manual_seed(2)) + 0.5
    ours.weight.copy_(weight)
    theirs.weight.data.copy_(weight)
    want_sum = x + residual
    with torch.inference_mode(), torch.profiler.profile() as prof:
        normed, total = ours.add_norm(x, residual)
    assert any(e.key == "switchyard_cpu::add_rms_norm" for e in prof.key_averages())
    assert total.data_ptr() == x.data_ptr()            # the sum is written over the sublayer's output
    assert torch.equal(total, want_sum)               # rounded as the op-by-op add rounds it
    assert torch.equal(residual, residual_before)
    assert normed.dtype == dtype and normed.is_contiguous()
    torch.testing.assert_close(normed, theirs(want_sum), **TOLERANCE[dtype])


def test_add_rms_norm_leaves_what_it_cannot_take_to_aten() -> None:
    """No residual (the first layer), a strided x, or a residual of another dtype: the op-by-op path."""
    weight = torch.ones(16)
    x = torch.randn(4, 16)
    normed, total = KERNELS.add_rms_norm(x, None, weight, 1e-6)
    assert total is x
    torch.testing.assert_close(normed, KERNELS.rms_norm(x, weight, 1e-6))
    strided = torch.randn(4, 20)[:, :16]
    cases = [(strided, torch.randn(4, 16)), (torch.randn(4, 16), torch.randn(4, 16, dtype=torch.float64))]
    for x, residual in cases:
        with torch.profiler.profile() as prof:
            normed, total = KERNELS.add_rms_norm(x, residual, weight, 1e-6)
        assert "switchyard_cpu::add_rms_norm" not in [e.key for e in prof.key_averages()]
        torch.testing.assert_close(total, x + residual)
        torch.testing.assert_close(normed, KERNELS.rms_norm(x + residual, weight, 1e-6))
    with pytest.raises(RuntimeError, match="alias"):
        torch.ops.switchyard_cpu.add_rms_norm(x.float(), x.float(), weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (9, 1536), (270, 1536), (4, 33)])
def test_silu_mul_matches_silu_times_up(dtype: torch.dtype, rows: int, width: int) -> None:
    gate_up = strided_rows(rows, 2 * width, dtype, seed=rows * width, scale=4.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 1e4, -1e4]).to(dtype)  # the tails
    with torch.inference_mode(), torch.profiler.profile() as prof:
        got = silu_mul(gate_up)
    assert any(e.key == "switchyard_cpu::silu_mul" for e in prof.key_averages())
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (37, 12, 64), (5, 4, 128), (3, 2, 10)])
def test_rotary_matches_transformers(dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> None:
    qkv = strided_rows(tokens, (heads + 2) * head_dim, dtype, seed=tokens * heads)
    x = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)   # strided tokens, as the model passes q|k
    positions = torch.arange(100, 100 + tokens)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = KERNELS.rotary_tables(inv_freq, positions, dtype)   # [tokens, 1, head_dim // 2]
    with torch.inference_mode(), torch.profiler.profile() as prof:
        got = rotate(x, cos, sin)
    assert any(e.key == "switchyard_cpu::rotary" for e in prof.key_averages())
    # transformers: [batch, heads, tokens, head_dim] with full-width tables [batch, tokens, head_dim]
    full_cos, full_sin = torch.cat((cos, cos), -1).squeeze(1)[None], torch.cat((sin, sin), -1).squeeze(1)[None]
    theirs, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], full_cos, full_sin)
    torch.testing.assert_close(got, theirs[0].transpose(0, 1), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 4, 4, 128),
                                                            (3, 2, 1, 10)])
def test_rotary_store_matches_transformers_and_index_copy(dtype: torch.dtype, tokens: int, heads: int,
                                                          kv_heads: int, head_dim: int) -> None:
    """q rotated out of a fused projection's strided rows, k rotated and v copied into the caches at the step's
    slots, against transformers' rotary and ATen's index_copy_; every other slot is left as it was."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv = strided_rows(tokens, width, dtype, seed=tokens * heads + kv_heads)
    positions = torch.arange(50, 50 + tokens)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = KERNELS.rotary_tables(inv_freq, positions, dtype)   # [tokens, 1, head_dim // 2]
    gen = torch.Generator().manual_seed(tokens)
    block_size, num_blocks = 16, 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    with torch.inference_mode(), torch.profiler.profile() as prof:
        q = KERNELS.rotary_store(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slots)
    assert any(e.key == "switchyard_cpu::rotary_store" for e in prof.key_averages())
    assert q is not None and q.shape == (tokens, heads, head_dim) and q.is_contiguous()
    full_cos, full_sin = torch.cat((cos, cos), -1).squeeze(1)[None], torch.cat((sin, sin), -1).squeeze(1)[None]
    qk = qkv[:, :(heads + kv_heads) * head_dim].reshape(tokens, heads + kv_heads, head_dim).transpose(0, 1)[None]
    rotated, _ = apply_rotary_pos_emb(qk, qk, full_cos, full_sin)
    rotated = rotated[0].transpose(0, 1)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(tokens, kv_heads, head_dim)
    torch.testing.assert_close(q, rotated[:, :heads], **TOLERANCE[dtype])
    flat = (num_blocks * block_size, kv_heads, head_dim)
    k_want = k_before.view(flat).index_copy(0, slots, rotated[:, heads:].contiguous())
    v_want = v_before.view(flat).index_copy(0, slots, v.contiguous())
    torch.testing.assert_close(k_cache.view(flat), k_want, **TOLERANCE[dtype])
    assert torch.equal(v_cache.view(flat), v_want)   # a copy, bit for bit
    others = torch.ones(flat[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(k_cache.view(flat)[others], k_before.view(flat)[others])


def test_rotary_store_refuses_a_slot_outside_the_cache_and_leaves_foreign_caches_to_aten() -> None:
    qkv = torch.randn(2, 5 * 8)
    cos, sin = torch.ones(2, 1, 4), torch.zeros(2, 1, 4)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.switchyard_cpu.rotary_store(qkv, cos, sin, 3, 1, k_cache, v_cache, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.switchyard_cpu.rotary_store(qkv, cos, sin, 3, 1, k_cache, v_cache, torch.tensor([-1, 0]))
    assert not k_cache.any() and not v_cache.any()   # checked before anything is written
    with pytest.raises(RuntimeError, match="rotary_store"):
        torch.ops.switchyard_cpu.rotary_store(qkv, cos, sin, 3, 1, k_cache[..., :4], v_cache, torch.tensor([0, 1]))
    # a cache of another dtype (an fp8 or float32 cache beside bf16 activations): the ATen path writes it
    assert KERNELS.rotary_store(qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), 3, 1, k_cache, v_cache,
                                torch.tensor([0, 1])) is None


def test_bad_shapes_raise_instead_of_crashing() -> None:
    ops = torch.ops.switchyard_cpu
    with pytest.raises(RuntimeError, match="rms_norm"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="rotary"):
        ops.rotary(torch.randn(2, 3, 8), torch.randn(2, 1, 3), torch.randn(2, 1, 3))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(torch.randn(2, 8, dtype=torch.float64))


def test_the_aten_path_where_the_kernels_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """float64, a tracked gradient, a 3-D RMSNorm input (Qwen3's per-head norms) and the switch: ATen ops."""
    norm = RMSNorm(16, 1e-6, KERNELS)
    cases = [
        lambda: norm.double()(torch.randn(4, 16, dtype=torch.float64)),
        lambda: silu_mul(torch.randn(4, 32, requires_grad=True)),
        lambda: RMSNorm(16, 1e-6, KERNELS)(torch.randn(4, 3, 16)),
    ]
    for case in cases:
        with torch.profiler.profile() as prof:
            case()
        assert not [e.key for e in prof.key_averages() if e.key.startswith("switchyard_cpu::")]
    monkeypatch.setenv(cpu.FUSED_SWITCH, "0")
    cpu.cpu_fused_layers.cache_clear()
    try:
        x = torch.randn(4, 32)
        with torch.profiler.profile() as prof:
            got = silu_mul(x)
        assert not [e.key for e in prof.key_averages() if e.key.startswith("switchyard_cpu::")]
        torch.testing.assert_close(got, F.silu(x[:, :16]) * x[:, 16:])
    finally:
        cpu.cpu_fused_layers.cache_clear()
