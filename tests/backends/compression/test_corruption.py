"""A damaged file is refused with a message naming the tensor, whatever region the damage hits."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backends.compression import CorruptWeightsError, compress_folder, load_compressed_file
from backends.compression.layout import Part, part_name

from .conftest import data_offset

TARGET = "victim.weight"


@pytest.fixture(scope="module")
def compressed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corrupt")
    gen = torch.Generator().manual_seed(0)
    weights = {
        TARGET: (torch.randn(600, 1000, generator=gen) * 0.02).to(torch.bfloat16),   # 3 chunks
        "other.weight": (torch.randn(64, 64, generator=gen) * 0.02).to(torch.bfloat16),
        "norm.weight": torch.ones(64, dtype=torch.bfloat16),
    }
    (root / "src").mkdir()
    save_file(weights, str(root / "src" / "model.safetensors"))
    compress_folder(root / "src", root / "dst")
    return root / "dst" / "model.safetensors"


def _damaged_copy(src: Path, tmp_path: Path, offset: int) -> Path:
    dst = tmp_path / "damaged.safetensors"
    shutil.copy(src, dst)
    data = bytearray(dst.read_bytes())
    data[offset] ^= 0x5A
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("part, within", [
    (Part.CODES, 0.0), (Part.CODES, 0.5), (Part.CODES, 1.0),
    (Part.RAW, 0.0), (Part.RAW, 0.99),
    (Part.LANES, 0.3), (Part.CHECKS, 0.5),
])
def test_flipped_byte_in_a_part_names_the_tensor(compressed_file: Path, tmp_path: Path, part: Part,
                                                 within: float) -> None:
    offset = data_offset(compressed_file, part_name(TARGET, part), within)
    with pytest.raises(CorruptWeightsError, match=re.escape(repr(TARGET))):
        load_compressed_file(_damaged_copy(compressed_file, tmp_path, offset))


def test_flipped_byte_in_a_plain_tensor_names_it(compressed_file: Path, tmp_path: Path) -> None:
    offset = data_offset(compressed_file, "norm.weight", 0.5)
    with pytest.raises(CorruptWeightsError, match=re.escape("'norm.weight'")):
        load_compressed_file(_damaged_copy(compressed_file, tmp_path, offset))


@pytest.mark.parametrize("field", ["threshold", "counts", "num_codes", "book_checksum", "shape"])
def test_flipped_digit_in_the_metadata_record_names_the_tensor(compressed_file: Path, tmp_path: Path,
                                                               field: str) -> None:
    raw = compressed_file.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    header = " " * 8 + raw[8:header_end].decode()        # keep string indices equal to file offsets
    record_at = header.index(f'\\"{TARGET}\\"')              # the record sits JSON-escaped inside the metadata
    field_at = header.index(f'\\"{field}\\"', record_at)
    digit_at = next(i for i in range(field_at, header_end) if header[i].isdigit() and header[i] != "0")
    data = bytearray(raw)
    data[digit_at] = ord("8") if header[digit_at] == "9" else ord(header[digit_at]) + 1   # still valid JSON
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError, match=re.escape(repr(TARGET))):
        load_compressed_file(damaged)


def test_flipped_byte_in_the_header_structure_is_refused(compressed_file: Path, tmp_path: Path) -> None:
    raw = compressed_file.read_bytes()
    entry_at = raw.index(part_name(TARGET, Part.RAW).encode())
    offsets_at = raw.index(b"data_offsets", entry_at)
    damaged = _damaged_copy(compressed_file, tmp_path, offsets_at + len("data_offsets") + 5)
    with pytest.raises(CorruptWeightsError):
        load_compressed_file(damaged)
    damaged = _damaged_copy(compressed_file, tmp_path, 10)      # inside the JSON syntax
    with pytest.raises(CorruptWeightsError):
        load_compressed_file(damaged)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.9999])
def test_truncated_file_names_a_tensor(compressed_file: Path, tmp_path: Path, keep: float) -> None:
    raw = compressed_file.read_bytes()
    damaged = tmp_path / "truncated.safetensors"
    damaged.write_bytes(raw[: int(len(raw) * keep)])
    with pytest.raises(CorruptWeightsError, match=r"tensor '|truncated"):
        load_compressed_file(damaged)


def test_intact_file_loads(compressed_file: Path) -> None:
    assert load_compressed_file(compressed_file)[TARGET].shape == (600, 1000)
