"""Weights kept compressed in memory, in GPU memory or in RAM, and expanded just before use (DFloat11's
approach; the worker's `--keep-weights-compressed`). Checksums are verified once, at load; then each
`CompressedTensor.decompress(out)` expands into a caller's buffer: on CUDA with a Triton kernel, one
program per lane (1024 symbols) that gathers its words' lengths and payloads from the dictionary,
prefix-sums the lengths and writes sign|exponent|mantissa directly; on the CPU with the C decoder
(cpu_decode.expand_chunk), chunk by chunk.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.compression.container import map_file
from backends.compression.cpu_decode import (
    DecodeTables,
    ScratchPool,
    book_key,
    checked_chunk,
    expand_chunk,
    load_plain,
    native_decoder,
    prepare_job,
    read_records,
    rebuild_tables,
)
from backends.compression.layout import (
    MAX_WORD_SYMBOLS,
    CompressedRecord,
    CorruptWeightsError,
    FloatKind,
    PlainRecord,
    chunk_bounds,
)

_OUT_DTYPES = {FloatKind.BF16: torch.bfloat16, FloatKind.FP16: torch.float16}


def triton_available() -> bool:
    """Triton comes with CUDA builds of torch; it is imported only when a tensor is expanded (its
    import costs ~0.14 s, which a CPU worker loading compressed weights should not pay)."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True, slots=True)
class CompressedTensor:
    record: CompressedRecord    # its metadata record (kind, shape, lanes, chunks)
    codes: torch.Tensor         # [num_codes] int16 codewords (bit pattern of uint16), on the device
    lane_starts: torch.Tensor   # [num_lanes + 1] int64 codeword offset of each lane
    payload: torch.Tensor       # [65536] int64 dictionary payloads (0 past the dictionary), on the device
    lengths: torch.Tensor       # [65536] uint8 dictionary word lengths (0 past it), on the device
    raw: torch.Tensor           # [numel] uint8 raw bytes
    tables: DecodeTables        # the CPU decoder's view of the dictionary (host memory)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.record.shape

    @property
    def dtype(self) -> torch.dtype:
        return _OUT_DTYPES[self.record.kind]

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def compressed_bytes(self) -> int:
        """Bytes it keeps on its device (the dictionary, shared with other tensors, not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lane_starts, self.raw))

    def decompress(self, out: torch.Tensor | None = None, use_triton: bool | None = None) -> torch.Tensor:
        """Expand into `out` (contiguous, its shape, dtype and device; else a new tensor), bit-exact
        with load_compressed_file. `use_triton`: default on CUDA; True on a CPU tensor runs the kernel
        under Triton's interpreter (TRITON_INTERPRET=1; tests only)."""
        if out is None:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if (out.dtype != self.dtype or out.device != self.device or out.numel() != self.record.numel
                or not out.is_contiguous()):
            raise ValueError(f"cannot expand a {self.dtype} {list(self.shape)} tensor on {self.device} into a "
                             f"{out.dtype} {list(out.shape)} tensor on {out.device}")
        if use_triton if use_triton is not None else self.device.type == "cuda":
            self._expand_triton(out)
        elif self.device.type == "cpu":
            self._expand_cpu(out)
        else:
            raise ValueError(f"no decoder for {self.device} without Triton")
        return out

    def _expand_triton(self, out: torch.Tensor) -> None:
        if not triton_available():
            raise RuntimeError("the GPU decoder needs Triton")
        from backends.compression.triton_kernel import decode_lanes_kernel
        num_lanes = self.lane_starts.numel() - 1
        decode_lanes_kernel[(num_lanes,)](
            self.codes, self.lane_starts, self.payload, self.lengths,
            self.raw, out.view(torch.int16), self.record.numel, LANE=self.record.lane_size, WORD=MAX_WORD_SYMBOLS,
            IS_BF16=self.record.kind is FloatKind.BF16,
        )

    def _expand_cpu(self, out: torch.Tensor) -> None:
        codes = self.codes.numpy().view(np.uint16)
        offsets, raw = self.lane_starts.numpy(), self.raw.numpy()
        bits = out.view(torch.int16).reshape(-1).numpy().view(np.uint16)
        scratches = None if native_decoder is not None else ScratchPool([self.record])
        for chunk in range(self.record.num_chunks):
            lo, hi, c0, c1 = chunk_bounds(self.record, offsets, chunk)
            if not expand_chunk(codes[c0:c1], self.tables, raw[lo:hi], bits[lo:hi], self.record.kind, scratches):
                raise CorruptWeightsError(f"compressed tensor {list(self.shape)}: chunk {chunk} does not decode")


def load_compressed_resident(path: Path | str,
                             device: torch.device | str) -> dict[str, CompressedTensor | torch.Tensor]:
    """Verify every chunk's stored checksums, then place the tensors on `device` still compressed.

    Plain tensors come back as ordinary tensors on `device`; compressed ones as CompressedTensor, to
    be expanded with `.decompress()` (e.g. layer by layer, just before the layer runs).
    """
    device = torch.device(device)
    mapped = map_file(Path(path))
    result: dict[str, CompressedTensor | torch.Tensor] = {}
    books: dict[tuple, tuple[DecodeTables, torch.Tensor, torch.Tensor]] = {}   # one device copy per dictionary
    for name, record in read_records(mapped).items():
        if isinstance(record, PlainRecord):
            result[name] = load_plain(mapped, name, record).to(device)
            continue
        key = book_key(record)
        if key not in books:
            tables = rebuild_tables(record, f"{mapped.path}: tensor {name!r}")   # rebuilds + checks it
            books[key] = (tables, torch.from_numpy(tables.payload.view(np.int64)).to(device),
                          torch.from_numpy(tables.lengths).to(device))
        tables, payload, lengths = books[key]
        # checks the parts' sizes; the host output is never written
        job, _ = prepare_job(mapped, name, record, tables, out=torch.empty(0, dtype=torch.int16))
        for chunk in range(record.num_chunks):
            checked_chunk(job, chunk)
        result[name] = CompressedTensor(
            record=record,
            codes=torch.from_numpy(job.codes.view(np.int16).copy()).to(device),
            lane_starts=torch.from_numpy(job.offsets).to(device),
            payload=payload, lengths=lengths,
            raw=torch.from_numpy(job.raw.copy()).to(device),
            tables=tables,
        )
    return result
