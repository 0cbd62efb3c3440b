"""CPU loader of compressed safetensors files: verify, decode and reassemble every tensor.

Each distinct dictionary is rebuilt once per file; then every (tensor, chunk) pair is a work item on a
thread pool: two checksums and one call of the C decoder (`_native.c`) on a ~256K-element chunk, all of
which release the GIL, writing straight into the output tensor. Where the C extension was not built
(no compiler at install time), the same chunk takes a dozen numpy/torch calls instead, through
per-thread scratch buffers, to the same bits at about a third of the speed.
"""
from __future__ import annotations

import mmap
import os
import queue
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.compression import codebook
from backends.compression.container import TORCH_DTYPES, MappedFile, map_file
from backends.compression.layout import (
    CRC32C,
    DATA_CHECKSUMS,
    FORMAT_KEY,
    NUM_CHECKS,
    TENSORS_KEY,
    Checksum,
    CompressedRecord,
    CorruptWeightsError,
    FloatKind,
    Part,
    PlainRecord,
    book_checksum,
    chunk_bounds,
    lane_offsets,
    part_name,
    records_from_json,
)
from backends.compression.native import native as native_decoder

_OUT_DTYPES = {FloatKind.BF16: torch.bfloat16, FloatKind.FP16: torch.float16}
_ARENA_ALIGN = 64       # bytes: every output tensor starts on a cache line
_NATIVE_KINDS = {FloatKind.BF16: 0, FloatKind.FP16: 1}   # `kind` argument of _native.decode_chunk


@dataclass(frozen=True, slots=True)
class DecodeTables:
    """A rebuilt dictionary as the CPU decoder uses it: indexed by any uint16 codeword."""
    payload: np.ndarray   # [65536] uint64 word symbols, first in the lowest byte (0 past the dictionary)
    lengths: np.ndarray   # [65536] uint8 word lengths (0 past the dictionary; codewords are checked first)
    num_words: int        # words in the dictionary


@dataclass(frozen=True, slots=True)
class DecodeJob:
    where: str                 # "<file>: tensor '<name>'" for error messages
    record: CompressedRecord   # the tensor's metadata record
    tables: DecodeTables       # its dictionary
    codes: np.ndarray          # [num_codes] little-endian uint16 codewords (memory-mapped)
    raw: np.ndarray            # [numel] uint8 raw bytes (memory-mapped)
    offsets: np.ndarray        # [num_lanes + 1] int64 codeword offset of each lane
    checks: np.ndarray         # [num_chunks, NUM_CHECKS] uint32 stored checksums
    out: np.ndarray            # [numel] uint16 view of the output tensor
    checksum: Checksum         # the file's data checksum


class Scratch:
    """One decoding thread's reusable buffers, sized for `max_codes` codewords and `chunk` elements."""

    def __init__(self, max_codes: int, chunk: int) -> None:
        self.index = np.empty(max_codes, np.intp)       # codewords as indices
        self.length = np.empty(max_codes, np.uint8)     # word lengths
        self.offset = np.empty(max_codes, np.int64)     # byte offset of each word in its 8-byte slot
        self.pos = np.empty(max_codes, np.int64)        # first symbol of each word
        self.word = np.empty(max_codes, np.uint64)      # word payloads
        self.shift = np.empty(max_codes, np.uint64)     # bit offset of each word in its 8-byte slot
        self.part = np.empty(max_codes, np.uint64)      # a payload's part falling in one slot
        self.slots = torch.zeros(chunk // 8 + 2, dtype=torch.int64)   # decoded symbols, 8 per slot
        self.high = np.empty(chunk, np.uint16)          # symbol bits of the output
        self.low = np.empty(chunk, np.uint16)           # raw bits of the output


def decode_tables(payload: np.ndarray, lengths: np.ndarray) -> DecodeTables:
    """Pad a dictionary's [K] payloads and lengths to every uint16 codeword."""
    padded_payload = np.zeros(codebook.MAX_CODEWORDS, np.uint64)
    padded_lengths = np.zeros(codebook.MAX_CODEWORDS, np.uint8)
    padded_payload[:payload.size] = payload
    padded_lengths[:lengths.size] = lengths
    return DecodeTables(padded_payload, padded_lengths, int(lengths.size))


def expand_into(codes: np.ndarray, tables: DecodeTables, num_symbols: int, scratch: Scratch) -> np.ndarray | None:
    """Codewords -> [num_symbols] uint8 symbols (a view of scratch), or None when their lengths do not add up.

    Each word's 8-byte payload, shifted to its byte offset, is added into the aligned 8-byte slot where
    it starts and the next one (`scatter_add_`: a word's bytes past its length are zero and words do
    not overlap, so adding is or-ing).
    """
    m = codes.size
    if m == 0 or int(codes.max()) >= tables.num_words:
        return None
    index, length, pos, offset = scratch.index[:m], scratch.length[:m], scratch.pos[:m], scratch.offset[:m]
    word, shift, part = scratch.word[:m], scratch.shift[:m], scratch.part[:m]
    np.copyto(index, codes, casting="unsafe")
    np.take(tables.lengths, index, out=length, mode="wrap")  # uint8 table: 64 KB stays in cache
    np.cumsum(length, dtype=np.int64, out=pos)
    if int(pos[-1]) != num_symbols:
        return None
    np.subtract(pos, length, out=pos)
    np.take(tables.payload, index, out=word, mode="wrap")
    np.bitwise_and(pos, 7, out=offset)                      # byte offset within the slot ...
    np.left_shift(offset, 3, out=shift, casting="unsafe")   # ... in bits
    np.right_shift(pos, 3, out=pos)                         # the slot
    slots = scratch.slots[: num_symbols // 8 + 2]
    slots.numpy().fill(0)                                   # numpy: never wakes torch's thread pool
    np.left_shift(word, shift, out=part)
    target = torch.from_numpy(pos)
    slots.scatter_add_(0, target, torch.from_numpy(part.view(np.int64)))
    np.subtract(np.uint64(64), shift, out=shift)
    np.right_shift(word, shift, out=part)                   # numpy gives 0 for a shift by 64
    slots[1:].scatter_add_(0, target, torch.from_numpy(part.view(np.int64)))
    return slots.numpy().view(np.uint8)[:num_symbols]


def merge_into(out: np.ndarray, symbols: np.ndarray, raw: np.ndarray, kind: FloatKind, scratch: Scratch) -> None:
    """Inverse of layout.split_symbols: [n] symbols + [n] raw bytes -> `out` ([n] uint16 float bits),
    built in scratch so that `out` (fresh memory) is written once and never read."""
    n = out.size
    high, low = scratch.high[:n], scratch.low[:n]
    if kind is FloatKind.BF16:
        np.multiply(raw, 0x101, out=low, dtype=np.uint16)    # raw in both bytes
        np.bitwise_and(low, 0x807F, out=low)                  # sign to bit 15, mantissa to bits 0-6
        np.left_shift(symbols, 7, out=high, dtype=np.uint16)
    else:
        np.copyto(low, raw, casting="unsafe")
        np.left_shift(symbols, 8, out=high, dtype=np.uint16)
    np.bitwise_or(high, low, out=out)


def expand_codes(codes: np.ndarray, payload: np.ndarray, lengths: np.ndarray, num_symbols: int) -> np.ndarray | None:
    """Codewords -> a new [num_symbols] uint8 symbol array (None when the lengths do not add up)."""
    result = expand_into(codes, decode_tables(payload, lengths), num_symbols, Scratch(codes.size, num_symbols))
    return None if result is None else result.copy()


class ScratchPool:
    """Scratch buffers handed to whichever pool thread runs a chunk (one per running chunk at most)."""

    def __init__(self, records: Iterable[CompressedRecord]) -> None:
        # a chunk has at most as many codewords as symbols (decode_chunk refuses more)
        self.max_chunk = max((min(record.chunk_size, record.numel) for record in records), default=0)
        self.free: queue.SimpleQueue[Scratch] = queue.SimpleQueue()

    def take(self) -> Scratch:
        try:
            return self.free.get_nowait()
        except queue.Empty:
            return Scratch(self.max_chunk, self.max_chunk)


def checked_chunk(job: DecodeJob, chunk: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(first element, end element, codewords, raw bytes) of a chunk whose stored checksums match."""
    lo, hi, c0, c1 = chunk_bounds(job.record, job.offsets, chunk)
    stored = job.checks[chunk]
    codes = job.codes[c0:c1]
    if job.checksum(codes.view(np.uint8)) != stored[0]:
        raise CorruptWeightsError(f"{job.where}: compressed chunk {chunk} fails its checksum")
    raw = job.raw[lo:hi]
    if job.checksum(raw) != stored[1]:
        raise CorruptWeightsError(f"{job.where}: raw sign/mantissa chunk {chunk} fails its checksum")
    return lo, hi, codes, raw


def decode_chunk(job: DecodeJob, chunk: int, scratches: ScratchPool | None) -> None:
    """Verify and decode one chunk into job.out; `scratches`: None for the C decoder."""
    lo, hi, codes, raw = checked_chunk(job, chunk)
    if not expand_chunk(codes, job.tables, raw, job.out[lo:hi], job.record.kind, scratches):
        raise CorruptWeightsError(f"{job.where}: codewords of chunk {chunk} do not decode to its size")


def decode_chunk_range(job: DecodeJob, first: int, end: int) -> None:
    """Verify and decode chunks [first, end) into job.out in one call into C (CRC-32C files only), which
    holds the GIL once per range instead of a few times per chunk: a loader thread then barely slows
    the interpreter's other threads (a worker reads its weights ahead while it imports)."""
    assert native_decoder is not None   # callers decode whole ranges only with the C decoder
    bad = native_decoder.decode_chunks(job.codes, job.tables.payload, job.tables.lengths, job.tables.num_words,
                                       job.raw, job.out, _NATIVE_KINDS[job.record.kind], job.offsets,
                                       job.record.lanes_per_chunk, job.record.chunk_size, job.checks, first, end)
    if bad >= 0:
        chunk, what = divmod(bad, 3)
        raise CorruptWeightsError(f"{job.where}: " + (f"compressed chunk {chunk} fails its checksum",
                                                      f"raw sign/mantissa chunk {chunk} fails its checksum",
                                                      f"codewords of chunk {chunk} do not decode to its size")[what])


def expand_chunk(codes: np.ndarray, tables: DecodeTables, raw: np.ndarray, out: np.ndarray, kind: FloatKind,
                 scratches: ScratchPool | None) -> bool:
    """Decode one chunk's codewords and raw bytes into `out` ([len(raw)] uint16 float bits), with the C
    decoder (`scratches` None) or numpy; False when the codewords do not decode to len(raw) symbols."""
    if codes.size > raw.size:     # every codeword stands for at least one symbol
        return False
    if scratches is None:
        assert native_decoder is not None   # no scratches: the caller chose the C decoder
        return native_decoder.decode_chunk(codes, tables.payload, tables.lengths, tables.num_words, raw, out,
                                           _NATIVE_KINDS[kind])
    scratch = scratches.take()
    try:
        symbols = expand_into(codes, tables, raw.size, scratch)
        if symbols is None:
            return False
        merge_into(out, symbols, raw, kind, scratch)
        return True
    finally:
        scratches.free.put(scratch)


def rebuild_tables(record: CompressedRecord, where: str, native: bool = native_decoder is not None) -> DecodeTables:
    """A dictionary from its stored counts and threshold, checked against its checksum; `native`:
    built by the C extension (~30x faster) rather than by codebook.build_codebook."""
    symbols, probs = codebook.alphabet_probabilities(np.array(record.alphabet), np.array(record.counts))
    try:
        tables = build_tables(symbols, probs, record.threshold, native)
    except ValueError as exc:
        raise CorruptWeightsError(f"{where}: codebook cannot be rebuilt ({exc})") from exc
    words = tables.num_words
    if book_checksum(tables.payload[:words], tables.lengths[:words]) != record.book_checksum:
        raise CorruptWeightsError(f"{where}: rebuilt codebook fails its checksum")
    return tables


def build_tables(symbols: np.ndarray, probs: np.ndarray, threshold: float, native: bool) -> DecodeTables:
    """The decoder's tables of the dictionary codebook.build_codebook builds; ValueError when it has
    too many words (or, in C, when the alphabet is empty)."""
    if not native:
        book = codebook.build_codebook(symbols, probs, threshold, links=False)
        return decode_tables(book.payload, book.lengths)
    assert native_decoder is not None   # `native` is true only where the extension is built
    payload = np.empty(codebook.MAX_CODEWORDS, np.uint64)
    lengths = np.empty(codebook.MAX_CODEWORDS, np.uint8)
    num_words = native_decoder.build_tables(np.ascontiguousarray(probs, np.float64),
                                            np.ascontiguousarray(symbols, np.uint8), float(threshold), payload, lengths)
    if num_words < 0:
        raise ValueError(f"threshold {threshold!r} gives more than {codebook.MAX_CODEWORDS} codewords")
    return DecodeTables(payload, lengths, num_words)


def book_key(record: CompressedRecord) -> tuple:
    """Records with equal keys share one dictionary (the compressor copies the shared book's fields)."""
    return record.alphabet, record.counts, record.threshold, record.book_checksum


def part_array(mapped: MappedFile, name: str, part: Part, dtype: np.dtype, where: str) -> np.ndarray:
    key = part_name(name, part)
    if key not in mapped.spans:
        raise CorruptWeightsError(f"{where}: part {part.value!r} is missing")
    return mapped.bytes_of(key).view(dtype)


def prepare_job(mapped: MappedFile, name: str, record: CompressedRecord, tables: DecodeTables | None = None,
                out: torch.Tensor | None = None) -> tuple[DecodeJob, torch.Tensor]:
    """Check a compressed tensor's parts against its record; `tables`: its dictionary when already
    rebuilt (else rebuilt here); `out`: where to decode it (else a new tensor)."""
    where = f"{mapped.path}: tensor {name!r}"
    lanes = part_array(mapped, name, Part.LANES, np.dtype("<u2"), where)
    codes = part_array(mapped, name, Part.CODES, np.dtype("<u2"), where)
    raw = part_array(mapped, name, Part.RAW, np.dtype(np.uint8), where)
    checks = part_array(mapped, name, Part.CHECKS, np.dtype("<u4"), where)
    if (lanes.size != record.num_lanes or codes.size != record.num_codes or raw.size != record.numel
            or checks.size != NUM_CHECKS * record.num_chunks):
        raise CorruptWeightsError(f"{where}: part sizes do not match its metadata record")
    offsets = lane_offsets(lanes)
    if int(offsets[-1]) != record.num_codes:
        raise CorruptWeightsError(f"{where}: lane table fails its consistency check")
    tables = tables or rebuild_tables(record, where)
    if out is None:
        out = torch.empty(record.shape, dtype=_OUT_DTYPES[record.kind])
    out_bits = out.view(torch.int16).reshape(-1).numpy().view(np.uint16)
    job = DecodeJob(where, record, tables, codes, raw, offsets, checks.reshape(record.num_chunks, NUM_CHECKS),
                    out_bits, data_checksum(mapped))
    return job, out


def load_plain(mapped: MappedFile, name: str, record: PlainRecord) -> torch.Tensor:
    key_info = mapped.spans.get(name)
    if key_info is None:
        raise CorruptWeightsError(f"{mapped.path}: tensor {name!r} is missing")
    dtype, shape, _, _ = key_info
    data = mapped.bytes_of(name)
    if data_checksum(mapped)(data) != record.checksum:
        raise CorruptWeightsError(f"{mapped.path}: tensor {name!r} fails its checksum")
    out = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    out.reshape(-1).view(torch.uint8).numpy()[:] = data
    return out


def data_checksum(mapped: MappedFile) -> Checksum:
    """The checksum of the file's chunks and plain tensors, by its format version."""
    checksum = DATA_CHECKSUMS.get(mapped.metadata.get(FORMAT_KEY, ""))
    if checksum is None:
        raise CorruptWeightsError(f"{mapped.path}: unsupported {FORMAT_KEY} {mapped.metadata.get(FORMAT_KEY)!r}")
    return checksum


def read_records(mapped: MappedFile) -> dict[str, CompressedRecord | PlainRecord]:
    data_checksum(mapped)
    if TENSORS_KEY not in mapped.metadata:
        raise CorruptWeightsError(f"{mapped.path}: metadata {TENSORS_KEY!r} is missing")
    return records_from_json(mapped.metadata[TENSORS_KEY], str(mapped.path))


def rebuild_all(mapped: MappedFile, records: dict[str, CompressedRecord], pool: ThreadPoolExecutor,
                native: bool = native_decoder is not None) -> dict[str, Future]:
    """name -> future of its DecodeTables; each distinct dictionary is rebuilt once, on the pool, and a
    failure names the first tensor that uses it."""
    by_key: dict[tuple, Future] = {}
    futures = {}
    for name, record in records.items():
        key = book_key(record)
        if key not in by_key:
            by_key[key] = pool.submit(rebuild_tables, record, f"{mapped.path}: tensor {name!r}", native)
        futures[name] = by_key[key]
    return futures


def output_arena(records: dict[str, CompressedRecord]) -> dict[str, torch.Tensor]:
    """Uninitialised output tensors for the compressed records, all in one anonymous mapping backed by
    transparent huge pages where the kernel offers them: first-touch page faults on fresh memory
    otherwise cost ~0.4 ns per output byte, as much as a third of the decode. The tensors share the
    mapping; it is freed when the last of them is."""
    sizes = {name: 2 * record.numel for name, record in records.items()}
    starts, total = {}, 0
    for name, size in sizes.items():
        starts[name] = total
        total += -(-size // _ARENA_ALIGN) * _ARENA_ALIGN
    if total == 0:
        return {name: torch.empty(rec.shape, dtype=_OUT_DTYPES[rec.kind]) for name, rec in records.items()}
    arena = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        arena.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(arena, dtype=torch.uint8)     # keeps `arena` alive
    return {name: memory[starts[name]:starts[name] + sizes[name]].view(_OUT_DTYPES[rec.kind]).view(rec.shape)
            for name, rec in records.items()}


def load_compressed_file(path: Path | str, num_threads: int | None = None,
                         native: bool | None = None) -> dict[str, torch.Tensor]:
    """Load a compressed safetensors file into CPU tensors, bit-exact; raises CorruptWeightsError
    (naming the tensor) instead of ever returning damaged weights. `native`: decode with the C
    extension (True: required), with numpy (False), or with the C extension where it was built (None)."""
    if native and native_decoder is None:
        raise RuntimeError("backends.compression._native was not built (no C compiler at install time?)")
    use_native = native_decoder is not None if native is None else native
    mapped = map_file(Path(path))
    records = read_records(mapped)
    compressed = {name: rec for name, rec in records.items() if isinstance(rec, CompressedRecord)}
    num_threads = num_threads or os.cpu_count() or 1
    scratches = None if use_native else ScratchPool(compressed.values())
    tensors: dict[str, torch.Tensor] = {}
    # Dictionaries are rebuilt (mostly under the GIL) on their own thread while the pool decodes the
    # tensors whose dictionary is ready (without the GIL): rebuilding ~20 dictionaries costs as much
    # as decoding MiniLM, so the two overlap instead of following each other.
    with (ThreadPoolExecutor(max_workers=1, thread_name_prefix="swz-books") as books,
          ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="swz-decode") as pool):
        tables = rebuild_all(mapped, compressed, books, use_native)
        for name, record in records.items():
            if isinstance(record, PlainRecord):
                tensors[name] = load_plain(mapped, name, record)
        outputs = output_arena(compressed)
        whole_ranges = use_native and data_checksum(mapped) is CRC32C
        futures = []
        for name, record in compressed.items():    # in the order the dictionaries are rebuilt
            job, tensors[name] = prepare_job(mapped, name, record, tables[name].result(), outputs[name])
            if whole_ranges:
                step = max(1, -(-record.num_chunks // num_threads))
                futures += [pool.submit(decode_chunk_range, job, first, min(first + step, record.num_chunks))
                            for first in range(0, record.num_chunks, step)]
            else:
                futures += [pool.submit(decode_chunk, job, chunk, scratches) for chunk in range(record.num_chunks)]
        for future in futures:
            future.result()
    return {name: tensors[name] for name in records}
