"""The float64 twin of transformers' SmolLM2, once per session: its logits stand in for the exact ones
when a test measures how large float32 rounding is (tests/backends/numerics.py)."""
from __future__ import annotations

import pytest
import torch

from tests.backends.numerics import float64_copy


@pytest.fixture(scope="session")
def hf_smollm2_f64(hf_smollm2: torch.nn.Module) -> torch.nn.Module:
    return float64_copy(hf_smollm2)
