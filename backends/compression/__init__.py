"""Lossless compression of bf16/fp16 weights (entropy-coded exponents, raw sign/mantissa) in a
valid safetensors container; see docs/compression.md for the layout."""
from backends.compression.compress import CastDtype, TensorStats, compress_file, compress_folder
from backends.compression.container import read_metadata
from backends.compression.cpu_decode import load_compressed_file
from backends.compression.layout import FORMAT_KEY, CorruptWeightsError
from backends.compression.resident import CompressedTensor, load_compressed_resident


def is_compressed_file(path) -> bool:
    """True when a safetensors file is in switchyard's compressed format (its metadata has FORMAT_KEY)."""
    return FORMAT_KEY in read_metadata(path)


__all__ = [
    "FORMAT_KEY", "CastDtype", "CompressedTensor", "CorruptWeightsError", "TensorStats", "compress_file",
    "compress_folder", "is_compressed_file", "load_compressed_file", "load_compressed_resident",
]
