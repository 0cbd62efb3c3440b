"""The optional C extension (`_native.c`, built by `pip install` where a C compiler is present), or None.

Every caller keeps a numpy path that gives the same results; tests compare the two.
"""
from __future__ import annotations

import importlib
from typing import Protocol

import numpy as np


class NativeCodec(Protocol):
    """The extension's functions (their docstrings in _native.c say what each does). Buffer arguments
    take anything with the buffer protocol; this codebase passes numpy arrays."""

    def decode_chunk(self, codes: np.ndarray, payload: np.ndarray, lengths: np.ndarray, num_words: int,
                     raw: np.ndarray, out: np.ndarray, kind: int, /) -> bool: ...

    def build_tables(self, probs: np.ndarray, symbols: np.ndarray, threshold: float, payload: np.ndarray,
                     lengths: np.ndarray, /) -> int: ...

    def encode_lanes(self, ranks: np.ndarray, first_child: np.ndarray, num_children: np.ndarray, lane_size: int,
                     codes: np.ndarray, lanes: np.ndarray, /) -> int: ...

    def decode_chunks(self, codes: np.ndarray, payload: np.ndarray, lengths: np.ndarray, num_words: int,
                      raw: np.ndarray, out: np.ndarray, kind: int, lane_offsets: np.ndarray, lanes_per_chunk: int,
                      chunk_size: int, checks: np.ndarray, first: int, end: int, /) -> int: ...

    def crc32c(self, data: np.ndarray, table: bool = False, /) -> int: ...


def _load() -> NativeCodec | None:
    try:
        return importlib.import_module("backends.compression._native")
    except ImportError:     # built without a C compiler
        return None


native = _load()

__all__ = ["NativeCodec", "native"]
