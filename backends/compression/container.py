"""A minimal safetensors writer and memory-mapped reader (the file format only, no codec).

Written files are ordinary safetensors files (the `safetensors` library opens them); reading
parses the header ourselves so a damaged file yields a message naming the tensor, not a panic.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.compression.layout import CorruptWeightsError

_HEADER_ALIGN = 8
_MAX_HEADER_BYTES = 100 * 1024 * 1024

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
_NUMPY_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32"}


@dataclass(frozen=True, slots=True)
class Entry:
    name: str               # tensor name in the file
    dtype: str              # safetensors dtype string ("U8", "BF16", ...)
    shape: tuple[int, ...]  # tensor shape
    data: np.ndarray        # contiguous bytes of the tensor (any numpy dtype; written as raw bytes)


def numpy_entry(name: str, array: np.ndarray) -> Entry:
    return Entry(name, _NUMPY_DTYPES[array.dtype], tuple(array.shape), np.ascontiguousarray(array))


def torch_entry(name: str, tensor: torch.Tensor) -> Entry:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return Entry(name, SAFETENSORS_DTYPES[tensor.dtype], tuple(tensor.shape), flat)


def write_safetensors(path: Path, entries: list[Entry], metadata: dict[str, str]) -> None:
    """Write `entries` in order, streaming each array's bytes (no whole-file buffer)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for entry in entries:
        size = entry.data.nbytes
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % _HEADER_ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for entry in entries:
            f.write(entry.data.data.cast("B"))


@dataclass(frozen=True, slots=True)
class MappedFile:
    path: Path                          # the file
    metadata: dict[str, str]            # its __metadata__
    spans: dict[str, tuple[str, tuple[int, ...], int, int]]  # name -> (dtype, shape, begin, end) in `data`
    data: np.ndarray                    # uint8 view of the whole data section (memory-mapped)

    def bytes_of(self, name: str) -> np.ndarray:
        _, _, begin, end = self.spans[name]
        return self.data[begin:end]


def read_metadata(path: Path) -> dict[str, str]:
    """Only the __metadata__ of a safetensors file (cheap: reads the header)."""
    with open(path, "rb") as f:
        header, _ = _read_header(f, path)
    return header.get("__metadata__") or {}


def _read_header(f, path: Path) -> tuple[dict, int]:
    raw_len = f.read(8)
    if len(raw_len) < 8:
        raise CorruptWeightsError(f"{path}: file is truncated (no safetensors header)")
    (n,) = struct.unpack("<Q", raw_len)
    if n > _MAX_HEADER_BYTES:
        raise CorruptWeightsError(f"{path}: header length {n} is implausible (corrupted file)")
    blob = f.read(n)
    if len(blob) < n:
        raise CorruptWeightsError(f"{path}: file is truncated inside the header")
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptWeightsError(f"{path}: safetensors header is corrupted ({exc})") from exc
    if not isinstance(header, dict):
        raise CorruptWeightsError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def map_file(path: Path) -> MappedFile:
    """Memory-map a safetensors file and check every tensor's span lies inside it."""
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
        size = f.seek(0, 2)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > data_start else b""
    data = np.frombuffer(mapped, np.uint8)[data_start:] if size > data_start else np.zeros(0, np.uint8)
    metadata = header.pop("__metadata__", None) or {}
    spans = {}
    for name, info in header.items():
        try:
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            itemsize = torch.empty(0, dtype=TORCH_DTYPES[dtype]).element_size()
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptWeightsError(f"{path}: tensor {name!r}: header entry is corrupted ({exc})") from exc
        if end > data.size:
            raise CorruptWeightsError(f"{path}: tensor {name!r}: data lies past the end of the file (truncated)")
        if not 0 <= begin <= end or end - begin != itemsize * math.prod(shape):
            raise CorruptWeightsError(f"{path}: tensor {name!r}: header entry is inconsistent with its shape")
        spans[name] = (dtype, shape, begin, end)
    return MappedFile(path, metadata, spans, data)
