"""The Triton kernels (paged-decode attention, compressed-weight decode) executed on the CPU by Triton's
interpreter, so that their logic is checked on every run, not only where a GPU is lent: attention
against SDPA, the weight decoder against the original bits and the C decoder. The interpreter must be
switched on before Triton is imported, so each check runs in a subprocess (tests/backends/triton_interpreted.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the test extra installs it on Linux x86_64)")

ROOT = Path(__file__).resolve().parents[2]
CHECKS = {"attention": 18, "compression": 4}   # lines each run must print: one per (shape, dtype, step) / tensor


@pytest.mark.parametrize("what", sorted(CHECKS))
def test_triton_kernel_under_the_interpreter(what: str, tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.backends.triton_interpreted", what, str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("==") == CHECKS[what], proc.stdout
