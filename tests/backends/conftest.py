"""Session fixtures of the backend tests: the float64 twin of transformers' SmolLM2 (its logits stand in for the
exact ones when a test measures how large float32 rounding is: tests/backends/numerics.py), and a second
revision of SmolLM2 in a folder of the same name."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.backends.numerics import float64_copy


@pytest.fixture(scope="session")
def hf_smollm2_f64(hf_smollm2: torch.nn.Module) -> torch.nn.Module:
    return float64_copy(hf_smollm2)


@pytest.fixture(scope="session")
def smollm2_revision_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model's folder, name and files, with every layer's k_proj scaled by 1.25: other KV for the
    same tokens, as a fine-tune or a new revision of a model has (a rolling upgrade)."""
    other_dir = tmp_path_factory.mktemp("revision-2") / smollm2_dir.name
    shutil.copytree(smollm2_dir, other_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in smollm2_dir.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({k: v * 1.25 if k.endswith("k_proj.weight") else v for k, v in tensors.items()},
                  str(other_dir / file.name))
    return other_dir
