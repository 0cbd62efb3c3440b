"""The kernel registry picks one family per device, and every family computes what the reference does.

Each family's ops run here on CPU tensors in float64 where they can (the CUDA family's are torch ops), so a
family's layout choices (full-width rotary tables, the residual inside addmm) are held to the reference
without a GPU; the fused C++ and Triton paths have their own tests (test_cpu_fused_layers.py, test_cuda_fused.py).
"""
from __future__ import annotations

import pytest
import torch

from backends.models.kernels.base import LayerKernels
from backends.models.kernels.cpu import CpuKernels
from backends.models.kernels.cuda import CudaKernels
from backends.models.kernels.registry import select_kernels, triton_enabled


@pytest.mark.parametrize("device,family", [
    ("cpu", "cpu"),
    ("cuda", "triton" if triton_enabled() else "cuda"),
    ("cuda:1", "triton" if triton_enabled() else "cuda"),
    ("meta", "torch"),
    ("mps", "torch"),
])
def test_select_kernels_picks_the_family_of_the_device(device: str, family: str) -> None:
    assert select_kernels(device).name == family
    assert select_kernels(torch.device(device)).name == family


FAMILIES: list[LayerKernels] = [LayerKernels(), CpuKernels(), CudaKernels()]
REFERENCE = LayerKernels()


@pytest.mark.parametrize("kernels", FAMILIES, ids=lambda k: k.name)
def test_each_family_matches_the_reference(kernels: LayerKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    weight = torch.rand(16, generator=gen, dtype=torch.float64) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6))
    residual = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    for got, want in zip(kernels.add_rms_norm(x.clone(), residual, weight, 1e-6),
                         REFERENCE.add_rms_norm(x.clone(), residual, weight, 1e-6), strict=True):
        torch.testing.assert_close(got, want)
    gate_up = torch.randn(5, 32, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(kernels.silu_mul(gate_up), REFERENCE.silu_mul(gate_up))

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).double() / 8))
    positions = torch.tensor([0, 3, 17, 40, 41])
    qk = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64)
    ours = kernels.rotate(qk, *kernels.rotary_tables(inv_freq, positions, torch.float64))
    torch.testing.assert_close(ours, REFERENCE.rotate(qk, *REFERENCE.rotary_tables(inv_freq, positions, torch.float64)))

    w = torch.randn(24, 16, generator=gen, dtype=torch.float64)   # [out, in]
    out_residual = torch.randn(5, 24, generator=gen, dtype=torch.float64)
    expected = out_residual + x @ w.t()
    torch.testing.assert_close(kernels.linear_add(x, w, False, out_residual), expected)
    torch.testing.assert_close(kernels.linear_add(x, w.t().contiguous(), True, out_residual), expected)
    torch.testing.assert_close(kernels.gemv(x[:1], w, (2, 16, 1)), x[:1] @ w.t())


def test_only_the_cpu_family_packs_float32_and_bfloat16_where_native() -> None:
    """float32 always; bfloat16 only where the CPU multiplies it natively, with a float32 copy for wide steps where
    that CPU has no AMX. Each packed product against the plain one, on whatever CPU runs the test."""
    weight = torch.randn(8, 4)
    assert LayerKernels().pack(weight, torch.float32) is None
    assert CudaKernels().pack(weight, torch.float32) is None
    assert LayerKernels().pack_wide(weight, torch.bfloat16) is None
    cpu = CpuKernels()
    assert cpu.pack_wide(weight, torch.float32) is None
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert (cpu.pack(weight, torch.bfloat16) is not None) == (native and torch.backends.mkldnn.is_available())
    if torch.backends.mkldnn.is_available():
        packed = cpu.pack(weight, torch.float32)
        assert packed is not None
        x = torch.randn(3, 4)
        torch.testing.assert_close(cpu.packed_linear(x, packed, None), x @ weight.t(), atol=1e-5, rtol=1e-5)
    narrow = weight.bfloat16()
    packed_bf16 = cpu.pack(narrow, torch.bfloat16)
    if packed_bf16 is not None:
        x16 = torch.randn(3, 4).bfloat16()
        want = (x16.float() @ narrow.float().t())
        torch.testing.assert_close(cpu.packed_linear(x16, packed_bf16, None).float(), want, atol=2e-2, rtol=2e-2)
        wide = cpu.pack_wide(narrow, torch.bfloat16)
        assert (wide is not None) == (not torch.cpu._is_amx_tile_supported())
        if wide is not None:
            torch.testing.assert_close(cpu.packed_linear(x16.float(), wide, None), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="pack no weights"):
        LayerKernels().packed_linear(torch.randn(1, 4), weight, None)


def test_the_one_row_kernel_finds_every_plain_projection() -> None:
    """tune_linears gives the one-row kernel to what gemv_projections finds: on every Python the plain [out, in]
    projections (a runtime protocol check finds none on 3.12, where an nn.Module's parameters are not seen)."""
    from backends.models.kernels.base import gemv_projections
    from backends.models.layers import Linear

    kernels = LayerKernels()
    narrowing, widening = Linear(64, 16, False, kernels), Linear(16, 64, False, kernels)   # float32: [in, out]
    biased = Linear(64, 16, True, kernels)
    model = torch.nn.ModuleDict({"down": narrowing, "up": widening, "biased": biased})
    assert gemv_projections(model) == [narrowing]
