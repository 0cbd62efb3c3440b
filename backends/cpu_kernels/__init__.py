"""The C++ kernels for the CPU: paged decode attention (paged_decode.cpp), fused layer ops (fused_layers.cpp) and
a sparse MLP's routed experts (moe_experts.cpp) and small products of plain weights (rows_linear.cpp), the last two
over the dot products of row_dots.h.

Built into one library once per machine, with the instruction set of the CPU torch runs on, into
$SWITCHYARD_CACHE/torch_extensions; loaded once per process, after which they are `torch.ops.switchyard_cpu.*`.
This module owns the build only: the attention backend (backends/attention/cpu_paged.py) and the layers
(backends/models/layers.py) decide where each kernel runs, and each has its own switch to turn it off.
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
from pathlib import Path

import torch

from backends.core.paths import default_cache_dir

log = logging.getLogger(__name__)

_FOLDER = Path(__file__).parent
_SOURCES = (_FOLDER / "paged_decode.cpp", _FOLDER / "fused_layers.cpp", _FOLDER / "moe_experts.cpp",
            _FOLDER / "rows_linear.cpp")
_HEADERS = (_FOLDER / "cpu_math.h", _FOLDER / "row_dots.h")

# The instruction sets torch found this CPU and its OS to support (cpuinfo, AVX-512 state saving included), as
# compiler flags. Not -march=native: torch's answer also honours ATEN_CPU_CAPABILITY, and gcc's reading of a
# hypervisor's CPUID can claim extensions the kernel does not enable. -mtune changes scheduling only.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def load() -> bool:
    """Whether the kernels are loaded: compiled on this machine's first call and loaded from the cache after.
    False when they cannot be built (no compiler): callers fall back to ATen ops. Logs once."""
    try:
        _build()
    except Exception:  # a missing compiler or a failed build must not stop the worker: ATen still works
        log.warning("CPU kernels unavailable: attention and layers run on ATen ops", exc_info=True)
        return False
    return True


def compile_flags() -> list[str]:
    """-O3, the ISA torch runs with here, OpenMP when torch's intra-op pool is OpenMP (at::parallel_for then
    expands to `omp parallel`; the library links libgomp.so.1, which resolves to the copy torch loaded).
    -fno-trapping-math lets gcc turn the exp's clamp into a vector blend (nothing here reads FP exceptions);
    without it the softmax loop stays scalar."""
    capability = torch.backends.cpu.get_cpu_capability()   # "AVX2", "AVX512", ... or "DEFAULT", "SVE256", ...
    isa = _ISA_FLAGS["AVX512"] if capability.startswith("AVX512") else _ISA_FLAGS.get(capability, [])
    if capability.startswith("AVX512") and torch.cpu._is_avx512_bf16_supported():
        isa = [*isa, "-mavx512bf16"]   # vdpbf16ps (paged_decode.cpp's bf16 scores)
    threads = ["-fopenmp"] if torch._C.has_openmp else ["-fopenmp-simd"]
    return ["-O3", "-fno-trapping-math", *isa, "-mtune=native", *threads]


def build_dir() -> Path:
    """One folder per (sources and where they lie, flags, torch, Python, machine): another CPU or torch gets a
    build of its own, and so does another checkout. ninja's build file names the sources by absolute path, so two
    checkouts sharing one folder would each rebuild (and replace the library) whenever the other had built."""
    key = hashlib.sha256("\n".join([
        *(path.read_text() for path in (*_SOURCES, *_HEADERS)), str(_FOLDER.resolve()), *compile_flags(),
        torch.__version__, sys.version, platform.machine(),
    ]).encode()).hexdigest()[:16]
    return default_cache_dir() / "torch_extensions" / f"cpu_kernels-{key}"


def _ninja_on_path() -> None:
    """torch's build runs `ninja` from PATH; a worker started as .venv/bin/python has no venv on its PATH,
    so without a system ninja, point PATH at the one the `ninja` package installed."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _build() -> None:
    from torch.utils.cpp_extension import load as load_extension  # imports setuptools: only when wanted

    if hasattr(torch.ops.switchyard_cpu, "paged_decode"):
        # Loaded before in this process (the cache was cleared): a second library registering the same
        # operators, from a changed source, would abort the process.
        return
    _ninja_on_path()
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    flags = compile_flags()
    start = time.perf_counter()
    # One object per source, compiled in parallel by ninja; "cpu_math.h" is found beside them.
    load_extension(name="switchyard_cpu_kernels", sources=[str(path) for path in _SOURCES], extra_cflags=flags,
                   extra_ldflags=["-fopenmp"] if torch._C.has_openmp else [], build_directory=str(folder),
                   is_python_module=False)
    log.info("CPU kernels loaded in %.1f s from %s (%s)", time.perf_counter() - start, folder, " ".join(flags))
