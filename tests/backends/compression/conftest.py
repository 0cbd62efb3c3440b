"""Shared inputs for the compression tests: adversarial tensors and a tiny model folder."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file


def bits_tensor(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16/fp16 tensor with exactly the given 16-bit patterns."""
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16).reshape(shape).copy()).view(dtype)


def adversarial_tensors() -> dict[str, torch.Tensor]:
    """Exponent distributions that stress the codec; shapes cover < 1 lane, odd sizes and > 1 chunk."""
    rng = np.random.default_rng(1234)
    out: dict[str, torch.Tensor] = {}
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        # every exponent, NaN/Inf payloads
        out[f"{tag}.all_patterns"] = bits_tensor(rng.permutation(65536), dtype, (256, 256))
        out[f"{tag}.uniform_bits"] = bits_tensor(rng.integers(0, 65536, 300_001), dtype, (300_001, 1))
        out[f"{tag}.single_value"] = bits_tensor(np.full(5000, 0x3F80), dtype, (50, 100))
        out[f"{tag}.zeros"] = torch.zeros(3, 7, dtype=dtype)
        denormal = rng.integers(0, 0x80, 4096) | (rng.integers(0, 2, 4096) << 15)        # exponent 0 (bf16 denormals)
        out[f"{tag}.denormals"] = bits_tensor(denormal, dtype, (64, 64))
        specials = np.array([0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7C00, 0xFC00, 0x7E00, 0x0001, 0x8000])
        out[f"{tag}.nan_inf"] = bits_tensor(rng.choice(specials, 999), dtype, (9, 111))
        two = np.where(rng.random(70_000) < 0.999, 0x3C00, 0x0400)                        # two exponents, one rare
        out[f"{tag}.skewed_pair"] = bits_tensor(two, dtype, (700, 100))
        out[f"{tag}.gaussian"] = (torch.randn(700, 1100, generator=torch.Generator().manual_seed(7)) * 0.02).to(dtype)
        out[f"{tag}.tiny"] = torch.tensor([[1.5, -2.0]], dtype=dtype)
        out[f"{tag}.rank3"] = (torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(8)) * 1e4).to(dtype)
    return out


def plain_tensors() -> dict[str, torch.Tensor]:
    """Tensors that must be stored as they are: 1-D, fp32, integer, bool, empty."""
    return {
        "norm.weight": torch.linspace(-1, 1, 577).to(torch.bfloat16),
        "fp32.matrix": torch.randn(8, 9),
        "int.ids": torch.arange(10, dtype=torch.int64).reshape(2, 5),
        "mask": torch.tensor([[True, False], [False, True]]),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="session")
def adversarial() -> dict[str, torch.Tensor]:
    return adversarial_tensors()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-style folder: two safetensors shards (adversarial + plain tensors) and a config."""
    folder = tmp_path_factory.mktemp("tiny_model")
    tensors = adversarial_tensors()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2]}, str(folder / "model-00001-of-00002.safetensors"))
    rest = {n: tensors[n] for n in names[len(names) // 2:]} | plain_tensors()
    save_file(rest, str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    return folder


@pytest.fixture(scope="session")
def smollm2_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(fp32 source folder, bf16 folder, compressed bf16 folder) of the bundled model."""
    from backends.compression import CastDtype, compress_folder
    from backends.worker.loader import resolve_model
    src = resolve_model("smollm2")
    root = tmp_path_factory.mktemp("smollm2")
    stats = compress_folder(src, root / "compressed", CastDtype.BF16)
    assert sum(s.stored_bytes for s in stats) <= 0.70 * sum(s.original_bytes for s in stats)
    bf16 = root / "bf16"
    shutil.copytree(src, bf16, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in src.glob("*.safetensors"):
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(str(file)).items()}
        save_file(tensors, str(bf16 / file.name))
    return src, bf16, root / "compressed"


def data_offset(path: Path, tensor: str, within: float) -> int:
    """The file offset of the byte `within` (0..1) of the way through a stored tensor or part."""
    from backends.compression.container import map_file
    _, _, begin, end = map_file(path).spans[tensor]
    header_bytes = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    return header_bytes + begin + int((end - begin - 1) * within)
