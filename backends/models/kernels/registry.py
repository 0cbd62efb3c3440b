"""Device family -> its layer kernels: adding a family is one file and one line here."""
from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch

from backends.models.kernels.base import LayerKernels
from backends.models.kernels.cpu import CpuKernels
from backends.models.kernels.cuda import select_cuda
from backends.models.kernels.torch_ref import TorchKernels

# torch.device.type -> factory; any other device runs the reference kernels
_FAMILIES: MappingProxyType[str, Callable[[], LayerKernels]] = MappingProxyType({
    "cpu": CpuKernels,
    "cuda": select_cuda,
})


def select_kernels(device: torch.device | str) -> LayerKernels:
    """The kernels for layers that run on `device`: called once, when a model (or a draft head) is built."""
    return _FAMILIES.get(torch.device(device).type, TorchKernels)()
