"""Device family -> its layer kernels: adding a family is one file and one line here."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import MappingProxyType

import torch

from backends.models.kernels.base import LayerKernels
from backends.models.kernels.cpu import CpuKernels
from backends.models.kernels.cuda import CudaKernels


def triton_enabled() -> bool:
    """Whether CUDA layers use the Triton kernels of triton_ops (Triton installed, not switched off)."""
    if importlib.util.find_spec("triton") is None:
        return False
    from backends.models.kernels import triton_ops  # imports Triton

    return triton_ops.ENABLED


def select_cuda() -> LayerKernels:
    """Triton's kernels where they can run (read once per model, so a CUDA graph keeps what it captured)."""
    if not triton_enabled():
        return CudaKernels()
    from backends.models.kernels.triton import TritonKernels

    return TritonKernels()


# torch.device.type -> factory; any other device runs the reference kernels
_FAMILIES: MappingProxyType[str, Callable[[], LayerKernels]] = MappingProxyType({
    "cpu": CpuKernels,
    "cuda": select_cuda,
})


def select_kernels(device: torch.device | str) -> LayerKernels:
    """The kernels for layers that run on `device`: called once, when a model (or a draft head) is built."""
    return _FAMILIES.get(torch.device(device).type, LayerKernels)()
