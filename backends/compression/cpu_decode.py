"""CPU loader of compressed safetensors files: verify, decode and reassemble every tensor.

Work items are (tensor, chunk) pairs run on a thread pool: every step is a numpy or zlib call on
a ~256K-element chunk, and those release the GIL, so chunks decode in parallel.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.compression import codebook
from backends.compression.container import TORCH_DTYPES, MappedFile, map_file
from backends.compression.layout import (
    FORMAT_KEY, FORMAT_VERSION, TENSORS_KEY, CompressedRecord, CorruptWeightsError, FloatKind, Part,
    PlainRecord, book_checksum, chunk_bounds, codes_checksum, lane_offsets, merge_symbols, part_name,
    raw_checksum, records_from_json, symbols_checksum,
)

_OUT_DTYPES = {FloatKind.BF16: torch.bfloat16, FloatKind.FP16: torch.float16}


@dataclass(frozen=True, slots=True)
class DecodeJob:
    where: str                 # "<file>: tensor '<name>'" for error messages
    record: CompressedRecord   # the tensor's metadata record
    payload: np.ndarray        # [K] uint64 dictionary payloads
    lengths: np.ndarray        # [K] uint8 dictionary word lengths
    codes: np.ndarray          # [num_codes] little-endian uint16 codewords (memory-mapped)
    raw: np.ndarray            # [numel] uint8 raw bytes (memory-mapped)
    offsets: np.ndarray        # [num_lanes + 1] int64 codeword offset of each lane
    checks: np.ndarray         # [num_chunks, 3] uint32 stored checksums
    out: np.ndarray            # [numel] uint16 view of the output tensor


def expand_codes(codes: np.ndarray, payload: np.ndarray, lengths: np.ndarray, num_symbols: int) -> np.ndarray | None:
    """Codewords -> [num_symbols] uint8 symbols, or None when their lengths do not add up.

    Each word's 8-byte payload is stored at its symbol offset through an unaligned uint64 view;
    writes go in index order, so each word's zero tail is overwritten by the words after it
    (the symbols checksum catches it should that ever not hold).
    """
    index = codes.astype(np.intp)
    word_lengths = np.take(lengths, index)
    pos = np.cumsum(word_lengths, dtype=np.intp)
    if pos.size == 0 or int(pos[-1]) != num_symbols:
        return None
    pos -= word_lengths
    buf = np.empty(num_symbols + 8, np.uint8)
    words = np.ndarray((num_symbols + 1,), np.uint64, buf, 0, (1,))  # unaligned, overlapping
    words[pos] = np.take(payload, index)
    return buf[:num_symbols]


def decode_chunk(job: DecodeJob, chunk: int) -> None:
    lo, hi, c0, c1 = chunk_bounds(job.record, job.offsets, chunk)
    stored = job.checks[chunk]
    codes = job.codes[c0:c1]
    if codes_checksum(codes.view(np.uint8)) != stored[0]:
        raise CorruptWeightsError(f"{job.where}: compressed chunk {chunk} fails its checksum")
    raw = job.raw[lo:hi]
    if raw_checksum(raw) != stored[1]:
        raise CorruptWeightsError(f"{job.where}: raw sign/mantissa chunk {chunk} fails its checksum")
    symbols = expand_codes(codes, job.payload, job.lengths, hi - lo)
    if symbols is None or symbols_checksum(symbols) != stored[2]:
        raise CorruptWeightsError(f"{job.where}: decoded exponents of chunk {chunk} fail their checksum")
    merge_symbols(job.out[lo:hi], symbols, raw, job.record.kind, np.empty(hi - lo, np.uint16))


def rebuild_codebook(record: CompressedRecord, where: str) -> codebook.Codebook:
    """The tensor's dictionary from its stored counts and threshold, checked against its checksum."""
    symbols, probs = codebook.alphabet_probabilities(np.array(record.alphabet), np.array(record.counts))
    try:
        book = codebook.build_codebook(symbols, probs, record.threshold)
    except ValueError as exc:
        raise CorruptWeightsError(f"{where}: codebook cannot be rebuilt ({exc})") from exc
    if book_checksum(book.payload, book.lengths) != record.book_checksum:
        raise CorruptWeightsError(f"{where}: rebuilt codebook fails its checksum")
    return book


def part_array(mapped: MappedFile, name: str, part: Part, dtype: np.dtype, where: str) -> np.ndarray:
    key = part_name(name, part)
    if key not in mapped.spans:
        raise CorruptWeightsError(f"{where}: part {part.value!r} is missing")
    return mapped.bytes_of(key).view(dtype)


def prepare_job(mapped: MappedFile, name: str, record: CompressedRecord) -> tuple[DecodeJob, torch.Tensor]:
    """Check a compressed tensor's parts against its record and allocate its output."""
    where = f"{mapped.path}: tensor {name!r}"
    lanes = part_array(mapped, name, Part.LANES, np.dtype("<u2"), where)
    codes = part_array(mapped, name, Part.CODES, np.dtype("<u2"), where)
    raw = part_array(mapped, name, Part.RAW, np.dtype(np.uint8), where)
    checks = part_array(mapped, name, Part.CHECKS, np.dtype("<u4"), where)
    if (lanes.size != record.num_lanes or codes.size != record.num_codes or raw.size != record.numel
            or checks.size != 3 * record.num_chunks):
        raise CorruptWeightsError(f"{where}: part sizes do not match its metadata record")
    offsets = lane_offsets(lanes)
    if int(offsets[-1]) != record.num_codes:
        raise CorruptWeightsError(f"{where}: lane table fails its consistency check")
    book = rebuild_codebook(record, where)
    out = torch.empty(record.shape, dtype=_OUT_DTYPES[record.kind])
    out_bits = out.view(torch.int16).reshape(-1).numpy().view(np.uint16)
    job = DecodeJob(where, record, book.payload, book.lengths, codes, raw, offsets,
                    checks.reshape(record.num_chunks, 3), out_bits)
    return job, out


def load_plain(mapped: MappedFile, name: str, record: PlainRecord) -> torch.Tensor:
    key_info = mapped.spans.get(name)
    if key_info is None:
        raise CorruptWeightsError(f"{mapped.path}: tensor {name!r} is missing")
    dtype, shape, _, _ = key_info
    data = mapped.bytes_of(name)
    if raw_checksum(data) != record.checksum:
        raise CorruptWeightsError(f"{mapped.path}: tensor {name!r} fails its checksum")
    out = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    out.reshape(-1).view(torch.uint8).numpy()[:] = data
    return out


def read_records(mapped: MappedFile) -> dict[str, CompressedRecord | PlainRecord]:
    if mapped.metadata.get(FORMAT_KEY) != FORMAT_VERSION:
        raise CorruptWeightsError(f"{mapped.path}: unsupported {FORMAT_KEY} {mapped.metadata.get(FORMAT_KEY)!r}")
    if TENSORS_KEY not in mapped.metadata:
        raise CorruptWeightsError(f"{mapped.path}: metadata {TENSORS_KEY!r} is missing")
    return records_from_json(mapped.metadata[TENSORS_KEY], str(mapped.path))


def load_compressed_file(path: Path | str, num_threads: int | None = None) -> dict[str, torch.Tensor]:
    """Load a compressed safetensors file into CPU tensors, bit-exact; raises CorruptWeightsError
    (naming the tensor) instead of ever returning damaged weights."""
    mapped = map_file(Path(path))
    records = read_records(mapped)
    num_threads = num_threads or os.cpu_count() or 1
    tensors: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="swz-decode") as pool:
        prepared = {name: pool.submit(prepare_job, mapped, name, record)
                    for name, record in records.items() if isinstance(record, CompressedRecord)}
        for name, record in records.items():
            if isinstance(record, PlainRecord):
                tensors[name] = load_plain(mapped, name, record)
        chunk_futures = []
        for name, future in prepared.items():
            job, tensors[name] = future.result()
            chunk_futures += [pool.submit(decode_chunk, job, chunk) for chunk in range(job.record.num_chunks)]
        for future in chunk_futures:
            future.result()
    return {name: tensors[name] for name in records}
