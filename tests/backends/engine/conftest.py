"""The real SmolLM2 runner, loaded once for every engine test that needs the model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_dir: Path):  # -> ModelRunner (imported lazily: pure tests need no model)
    from backends.worker.model_runner import ModelRunner

    return ModelRunner(smollm2_dir, dtype=torch.float32, device="cpu", num_blocks=96, block_size=16,
                       fingerprint_weights=True)   # for KV tiers on disk or in a store
