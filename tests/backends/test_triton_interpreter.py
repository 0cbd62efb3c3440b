"""The Triton kernels (paged-decode attention, latent-attention decode,
the grouped expert products, compressed-weight decode) executed on the CPU by Triton's
interpreter, so that their logic is checked on every run, not only where a GPU is lent: attention
against SDPA, the weight decoder against the original bits and the C decoder. The interpreter must be
switched on before Triton is imported, so each check runs in a subprocess (tests/backends/triton_interpreted.py)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# `make setup` installs Triton into a folder of its own (Linux x86_64 wheels only) and `make test` names
# it here; the main venv stays without Triton (transformers would import it into every worker).
TRITON_PATH = os.environ.get("SWITCHYARD_TRITON_PATH")
pytestmark = pytest.mark.skipif(not TRITON_PATH or (platform.system(), platform.machine()) != ("Linux", "x86_64"),
                                reason="run through `make test` on Linux x86_64, which installs Triton for it")

ROOT = Path(__file__).resolve().parents[2]
# lines each run must print: one per (shape, dtype, step) / (shape, dtype) / tensor
CHECKS = {"attention": 18, "static_decode": 6, "compression": 5, "decode_splits": 12, "fused_layers": 14,
          "moe_experts": 5, "latent_decode": 18}


@pytest.mark.parametrize("what", sorted(CHECKS))
def test_triton_kernel_under_the_interpreter(what: str, tmp_path: Path) -> None:
    triton_path = Path(TRITON_PATH).resolve()
    assert (triton_path / "triton").is_dir(), f"Triton is missing from {triton_path}: run `make setup`"
    path = os.pathsep.join(p for p in (str(triton_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "tests.backends.triton_interpreted", what, str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("==") == CHECKS[what], proc.stdout
