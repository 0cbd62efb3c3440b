"""The Triton decoder on CUDA gives the same bits as the CPU decoder (skipped without CUDA)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.compression import compress_folder, load_compressed_file

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_decode_matches_cpu_bit_for_bit(tiny_model: Path, tmp_path: Path) -> None:
    from backends.compression.resident import CompressedTensor, load_compressed_resident, triton_available
    if not triton_available():
        pytest.skip("Triton is not installed")
    compress_folder(tiny_model, tmp_path / "out")
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        cpu = load_compressed_file(file)
        gpu = load_compressed_resident(file, "cuda")
        assert gpu.keys() == cpu.keys()
        for name, item in gpu.items():
            tensor = item.decompress() if isinstance(item, CompressedTensor) else item
            want = cpu[name]
            assert tensor.is_cuda and tensor.dtype == want.dtype and tensor.shape == want.shape, name
            # exact: both decoders are lossless
            assert torch.equal(tensor.cpu().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
