"""One rank's slices of a compressed safetensors file (`switchyard compress`, backends/compression): a tensor's rows
are decoded from the checksummed chunks that hold them, and no other; a slice of columns (a row-parallel
projection's) takes every chunk, since each row holds some of it. Bit-exact with decoding the whole file
(load_compressed_file) and slicing it.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from backends.compression.container import map_file
from backends.compression.cpu_decode import (
    DecodeTables,
    ScratchPool,
    book_key,
    decode_chunk,
    load_plain,
    native_decoder,
    prepare_job,
    read_records,
    rebuild_tables,
)
from backends.compression.layout import CompressedRecord, PlainRecord, chunk_bounds

Rows = tuple[int, int, int] | None   # (dim, start, stop) of a TPLayout slice; None: the whole tensor


class CompressedSlices:
    """The tensors of one compressed file by HF name; `read` decodes a slice of one."""

    def __init__(self, path: Path) -> None:
        self._mapped = map_file(path)
        self._records = read_records(self._mapped)
        self._tables: dict[tuple, DecodeTables] = {}   # a dictionary rebuilt once for the tensors that share it

    def names(self) -> Iterable[str]:
        return self._records.keys()

    def read(self, name: str, rows: Rows) -> tuple[torch.Tensor, int]:
        """The tensor's [start, stop) along `dim` (clipped to its end), or all of it, as a tensor of its own, and the
        bytes of the file read for it."""
        record = self._records[name]
        if isinstance(record, PlainRecord):   # norms, biases: small, read whole
            tensor = load_plain(self._mapped, name, record)
            return _sliced(tensor, rows), tensor.numel() * tensor.element_size()
        assert isinstance(record, CompressedRecord)
        key = book_key(record)
        tables = self._tables.get(key)
        if tables is None:
            tables = self._tables[key] = rebuild_tables(record, f"{self._mapped.path}: tensor {name!r}")
        job, whole = prepare_job(self._mapped, name, record, tables)
        first, end = _chunks_of(record, rows)
        scratches = None if native_decoder is not None else ScratchPool([record])
        read = 0
        for chunk in range(first, end):
            decode_chunk(job, chunk, scratches)   # checks the chunk's checksums first
            lo, hi, c0, c1 = chunk_bounds(record, job.offsets, chunk)
            read += (hi - lo) + 2 * (c1 - c0)      # its raw bytes and its 16-bit codewords
        return _sliced(whole, rows), read


def _chunks_of(record: CompressedRecord, rows: Rows) -> tuple[int, int]:
    """The chunks [first, end) that hold a slice's elements: a range of rows lies in consecutive elements."""
    if rows is None or rows[0] != 0:
        return 0, record.num_chunks
    _, start, stop = rows
    row = record.numel // record.shape[0] if record.shape[0] else 0
    lo, hi = start * row, min(stop, record.shape[0]) * row
    if hi <= lo:
        return 0, 0
    return lo // record.chunk_size, -(-hi // record.chunk_size)


def _sliced(tensor: torch.Tensor, rows: Rows) -> torch.Tensor:
    """A copy of the slice (so that the whole tensor it came from is freed), or the tensor itself."""
    if rows is None:
        return tensor
    dim, start, stop = rows
    return (tensor[start:stop] if dim == 0 else tensor[:, start:stop]).clone()
