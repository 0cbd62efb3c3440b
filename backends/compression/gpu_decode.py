"""GPU path: keep a tensor compressed in device memory and expand it with a Triton kernel just
before use. One program decodes one lane (1024 symbols) from its codeword offset: it gathers the
words' lengths and payloads from the dictionary, prefix-sums the lengths, and writes
sign|exponent|mantissa directly. Host-side checksums are verified once, at load.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.compression.container import map_file
from backends.compression.cpu_decode import (
    DecodeJob, DecodeTables, book_key, load_plain, prepare_job, read_records, rebuild_tables,
)
from backends.compression.layout import MAX_WORD_SYMBOLS, CorruptWeightsError, FloatKind, PlainRecord, chunk_bounds

_OUT_DTYPES = {FloatKind.BF16: torch.bfloat16, FloatKind.FP16: torch.float16}


def triton_available() -> bool:
    """Triton comes with CUDA builds of torch; it is imported only when a tensor is expanded (its
    import costs ~0.14 s, which a CPU worker loading compressed weights should not pay)."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True, slots=True)
class GpuCompressedTensor:
    kind: FloatKind             # output dtype
    shape: tuple[int, ...]      # output shape
    lane_size: int              # symbols per lane (one program)
    codes: torch.Tensor         # [num_codes] int16 codewords (bit pattern of uint16), on the device
    lane_starts: torch.Tensor   # [num_lanes + 1] int64 codeword offset of each lane
    payload: torch.Tensor       # [K] int64 dictionary payloads (bit pattern of uint64)
    lengths: torch.Tensor       # [K] uint8 dictionary word lengths
    raw: torch.Tensor           # [numel] uint8 raw bytes

    @property
    def compressed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lane_starts, self.raw))

    def decompress(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Expand into `out` (or a new tensor) on the device; bit-exact with the CPU decoder."""
        if not triton_available():
            raise RuntimeError("the GPU decoder needs Triton")
        from backends.compression.triton_kernel import decode_lanes_kernel
        numel = self.raw.numel()
        if out is None:
            out = torch.empty(self.shape, dtype=_OUT_DTYPES[self.kind], device=self.raw.device)
        num_lanes = self.lane_starts.numel() - 1
        decode_lanes_kernel[(num_lanes,)](
            self.codes, self.lane_starts, self.payload, self.lengths, self.raw, out.view(torch.int16),
            numel, LANE=self.lane_size, WORD=MAX_WORD_SYMBOLS, IS_BF16=self.kind is FloatKind.BF16,
        )
        return out


def load_compressed_gpu(path: Path | str, device: torch.device | str) -> dict[str, GpuCompressedTensor | torch.Tensor]:
    """Verify every chunk's stored checksums on the host, then upload the tensors still compressed.

    Plain tensors come back as ordinary device tensors; compressed ones as GpuCompressedTensor,
    to be expanded with `.decompress()` (e.g. layer by layer, just before the layer runs).
    """
    mapped = map_file(Path(path))
    result: dict[str, GpuCompressedTensor | torch.Tensor] = {}
    books: dict[tuple, tuple[DecodeTables, torch.Tensor, torch.Tensor]] = {}   # one device copy per dictionary
    for name, record in read_records(mapped).items():
        if isinstance(record, PlainRecord):
            result[name] = load_plain(mapped, name, record).to(device)
            continue
        key = book_key(record)
        if key not in books:
            tables = rebuild_tables(record, f"{mapped.path}: tensor {name!r}")   # rebuilds + checks it
            books[key] = (tables, torch.from_numpy(tables.payload[:tables.num_words].view(np.int64)).to(device),
                          torch.from_numpy(tables.lengths[:tables.num_words].copy()).to(device))
        tables, payload, lengths = books[key]
        # checks the parts' sizes; the host output is never written (the device decodes)
        job, _ = prepare_job(mapped, name, record, tables, out=torch.empty(0, dtype=torch.int16))
        _verify_chunks(job)
        result[name] = GpuCompressedTensor(
            kind=record.kind, shape=record.shape, lane_size=record.lane_size,
            codes=torch.from_numpy(job.codes.view(np.int16).copy()).to(device),
            lane_starts=torch.from_numpy(job.offsets).to(device),
            payload=payload, lengths=lengths,
            raw=torch.from_numpy(job.raw.copy()).to(device),
        )
    return result


def _verify_chunks(job: DecodeJob) -> None:
    for chunk in range(job.record.num_chunks):
        lo, hi, c0, c1 = chunk_bounds(job.record, job.offsets, chunk)
        if job.checksum(job.codes[c0:c1].view(np.uint8)) != job.checks[chunk, 0]:
            raise CorruptWeightsError(f"{job.where}: compressed chunk {chunk} fails its checksum")
        if job.checksum(job.raw[lo:hi]) != job.checks[chunk, 1]:
            raise CorruptWeightsError(f"{job.where}: raw sign/mantissa chunk {chunk} fails its checksum")
