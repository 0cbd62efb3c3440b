"""The CPU paged-decode kernel (cpu_paged_decode.cpp): built once per machine, loaded once per process.

It owns the build (flags for the CPU torch runs on, a cache folder keyed by source, flags and torch); the
per-step decode rows the kernel reads are base.DecodeRows. It does not decide which chunks run where (the
SDPA backend does).
Set SWITCHYARD_CPU_PAGED_ATTENTION=0 to turn the kernel off (decodes go back to gather + SDPA).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from backends.attention.base import AttentionShape
from backends.worker.loader import default_cache_dir

log = logging.getLogger(__name__)

ENV_SWITCH = "SWITCHYARD_CPU_PAGED_ATTENTION"
_SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
_DTYPES = (torch.float32, torch.bfloat16)
# The kernel's stack buffers (cpu_paged_decode.cpp, kMax*): a shape beyond them decodes with SDPA.
_MAX_GROUP, _MAX_HEAD_DIM = 16, 256

# The instruction sets torch found this CPU and its OS to support (cpuinfo, AVX-512 state saving included), as
# compiler flags. Not -march=native: torch's answer also honours ATEN_CPU_CAPABILITY, and gcc's reading of a
# hypervisor's CPUID can claim extensions the kernel does not enable. -mtune changes scheduling only.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

# q [n, heads, head_dim], k/v cache, block_tables [n, max_blocks], seq_lens [n], scale -> [n, heads, head_dim]
PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def supports(shape: AttentionShape) -> bool:
    """Whether the kernel handles this attention shape (else its decodes stay with SDPA)."""
    group = shape.num_heads // shape.num_kv_heads
    return shape.dtype in _DTYPES and group <= _MAX_GROUP and shape.head_dim <= _MAX_HEAD_DIM


@functools.cache
def load_paged_decode() -> PagedDecode | None:
    """The kernel, compiled on this machine's first call and loaded from the cache after; None when it is
    switched off or cannot be built (no compiler): the caller falls back to gather + SDPA. Logs once."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("CPU paged decode attention off (%s=0): decodes gather blocks for SDPA", ENV_SWITCH)
        return None
    try:
        return _build()
    except Exception:  # a missing compiler or a failed build must not stop the worker: SDPA still works
        log.warning("CPU paged decode attention unavailable, decodes gather blocks for SDPA", exc_info=True)
        return None


def compile_flags() -> list[str]:
    """-O3, the ISA torch runs with here, OpenMP when torch's intra-op pool is OpenMP (at::parallel_for then
    expands to `omp parallel`; the extension links libgomp.so.1, which resolves to the copy torch loaded).
    -fno-trapping-math lets gcc turn the exp's clamp into a vector blend (nothing here reads FP exceptions);
    without it the softmax loop stays scalar."""
    capability = torch.backends.cpu.get_cpu_capability()   # "AVX2", "AVX512", ... or "DEFAULT", "SVE256", ...
    isa = _ISA_FLAGS["AVX512"] if capability.startswith("AVX512") else _ISA_FLAGS.get(capability, [])
    threads = ["-fopenmp"] if torch._C.has_openmp else ["-fopenmp-simd"]
    return ["-O3", "-fno-trapping-math", *isa, "-mtune=native", *threads]


def build_dir() -> Path:
    """One folder per (source, flags, torch, Python, machine): another CPU or torch gets a build of its own."""
    key = hashlib.sha256("\n".join([
        _SOURCE.read_text(), *compile_flags(), torch.__version__, sys.version, platform.machine(),
    ]).encode()).hexdigest()[:16]
    return default_cache_dir() / "torch_extensions" / f"cpu_paged_decode-{key}"


def _ninja_on_path() -> None:
    """torch's build runs `ninja` from PATH; a worker started as .venv/bin/python has no venv on its PATH,
    so without a system ninja, point PATH at the one the `ninja` package installed."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _build() -> PagedDecode:
    from torch.utils.cpp_extension import load_inline   # imports setuptools: only when the kernel is wanted

    if hasattr(torch.ops.switchyard_cpu, "paged_decode"):
        # Loaded before in this process (the cache was cleared): a second library registering the same
        # operator namespace, from a changed source, would abort the process.
        loaded: PagedDecode = torch.ops.switchyard_cpu.paged_decode
        return loaded
    _ninja_on_path()
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    flags = compile_flags()
    start = time.perf_counter()
    load_inline(name="switchyard_cpu_paged_decode", cpp_sources=[_SOURCE.read_text()], extra_cflags=flags,
                extra_ldflags=["-fopenmp"] if torch._C.has_openmp else [], build_directory=str(folder),
                is_python_module=False, no_implicit_headers=True)
    log.info("CPU paged decode attention loaded in %.1f s from %s (%s)", time.perf_counter() - start, folder,
             " ".join(flags))
    op: PagedDecode = torch.ops.switchyard_cpu.paged_decode
    return op
