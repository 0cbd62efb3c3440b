"""The worker process's heap: glibc malloc told to keep the memory a step frees, for the next step to reuse.

A forward pass allocates tensors of tens of megabytes and frees them at its end (torch's CPU allocator has no
cache of its own). glibc gives memory back to the kernel when a freed block lies at the top of its heap or was
mapped on its own, so the next step touches fresh pages: a prefill step of moe_bench's model took 32,000-44,000
page faults on the AMX Xeon; kept, the second such step took 6,600 and 373 ms against 444. With a fixed mmap
threshold at glibc's largest (32 MiB), every smaller block comes from the heap, and a trim threshold of 1 GiB
keeps the freed heap. The process then holds its busiest step's temporaries after the step, as vLLM's CPU
worker does with tcmalloc.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20     # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); blocks from this size get mappings
TRIM_THRESHOLD = 1 << 30      # the free memory at a heap's top kept before any goes back
TOP_PAD = 64 << 20            # a heap grows by this much more than asked, in one system call


def keep_freed_memory() -> bool:
    """Whether glibc's malloc now keeps freed memory (False where the C library is not glibc). Call it once, at
    the start of a worker or rank process, before the model loads."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.info("no mallopt in this C library: the heap keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)
