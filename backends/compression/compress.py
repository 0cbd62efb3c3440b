"""Compression side: tensors -> compressed records and parts, safetensors files -> compressed files,
and HF folders -> compressed folders (with every non-weight file copied).

Decoding lives in cpu_decode.py / resident.py; this module never loads a model for inference.
"""
from __future__ import annotations

import enum
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from backends.compression import codebook
from backends.compression.container import Entry, numpy_entry, torch_entry, write_safetensors
from backends.compression.layout import (
    DATA_CHECKSUMS,
    FORMAT_KEY,
    FORMAT_VERSION,
    LANE_SIZE,
    NUM_CHECKS,
    TENSORS_KEY,
    Checksum,
    CompressedRecord,
    FloatKind,
    Part,
    PlainRecord,
    Record,
    book_checksum,
    chunk_bounds,
    lane_offsets,
    part_name,
    records_to_json,
    split_symbols,
)


class CastDtype(enum.Enum):
    """Target dtype of `--cast`: every floating-point tensor is cast to it before compression."""
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is CastDtype.BF16 else torch.float16


_KINDS = {torch.bfloat16: FloatKind.BF16, torch.float16: FloatKind.FP16}
_BATCH_SYMBOLS = 1 << 24   # tensors parsed together in one lockstep pass (bounds the encoder's memory)
SHARE_TOLERANCE = 0.01     # share a dictionary when it costs at most 1% more bits per exponent (SmolLM2:
                           # 211 matrices -> 17 dictionaries for +0.04% of the file; fewer to rebuild)


@dataclass(frozen=True, slots=True)
class TensorStats:
    name: str            # tensor name
    original_bytes: int  # bytes of the tensor as stored before (after the cast)
    stored_bytes: int    # bytes of all its parts in the compressed file
    compressed: bool     # False when stored as is


def compressible_kind(tensor: torch.Tensor) -> FloatKind | None:
    """bf16/fp16 matrices (ndim >= 2, non-empty) are compressed; everything else is stored as is."""
    if tensor.ndim < 2 or tensor.numel() == 0:
        return None
    return _KINDS.get(tensor.dtype)


@dataclass(frozen=True, slots=True)
class SharedBook:
    """A dictionary already used in the file being written; later tensors may share it."""
    alphabet: tuple[int, ...]  # its symbols, most probable first
    counts: tuple[int, ...]    # the counts it was built from (same order)
    threshold: float           # its threshold
    checksum: int              # book_checksum of its tables
    book: codebook.Codebook    # the tables themselves


def compress_tensor(tensor: torch.Tensor, kind: FloatKind) -> tuple[CompressedRecord, dict[Part, np.ndarray]]:
    """Compress one tensor with its own dictionary; see compress_tensors."""
    return compress_tensors([(tensor, kind)], [])[0]


def choose_book(counts: np.ndarray, shared: list[SharedBook]) -> SharedBook:
    """The tensor's own dictionary, or a shared one costing at most SHARE_TOLERANCE more bits per
    exponent (then the loader rebuilds one dictionary for many tensors); new ones join `shared`."""
    alphabet, probs = codebook.alphabet_probabilities(np.arange(256), counts)
    threshold = codebook.choose_threshold(probs)
    own_book = codebook.build_codebook(alphabet, probs, threshold)
    probs256 = counts / counts.sum()
    best_len, best = codebook.expected_word_length(own_book, probs256) / (1 + SHARE_TOLERANCE), None
    used = set(alphabet.tolist())
    for candidate in shared:
        if used <= set(candidate.alphabet):
            mean_len = codebook.expected_word_length(candidate.book, probs256)
            if mean_len >= best_len:
                best_len, best = mean_len, candidate
    if best is None:
        best = SharedBook(tuple(int(a) for a in alphabet), tuple(int(c) for c in counts[alphabet]), threshold,
                          book_checksum(own_book.payload, own_book.lengths), own_book)
        shared.append(best)
    return best


def compress_tensors(items: list[tuple[torch.Tensor, FloatKind]], shared: list[SharedBook],
                     checksum: Checksum = DATA_CHECKSUMS[FORMAT_VERSION],
                     ) -> list[tuple[CompressedRecord, dict[Part, np.ndarray]]]:
    """Split each tensor into symbols + raw bytes, pick its dictionary (see choose_book), encode all of
    them in one lockstep pass, and checksum each chunk."""
    prepared = []
    for tensor, kind in items:
        bits = tensor.detach().contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)
        symbols, raw = split_symbols(bits, kind)
        chosen = choose_book(np.bincount(symbols, minlength=256), shared)
        rank_of = np.zeros(256, np.int32)
        rank_of[list(chosen.alphabet)] = np.arange(len(chosen.alphabet))
        record = CompressedRecord(
            kind=kind, shape=tuple(tensor.shape), alphabet=chosen.alphabet, counts=chosen.counts,
            threshold=chosen.threshold, book_checksum=chosen.checksum, num_codes=0,
        )
        prepared.append((record, raw, rank_of[symbols], chosen.book))
    encoded = codebook.encode_many([(ranks, book) for _, _, ranks, book in prepared], LANE_SIZE)
    return [_with_checks(record, raw, codes, lanes, checksum)
            for (record, raw, _, _), (codes, lanes) in zip(prepared, encoded, strict=True)]


def _with_checks(record: CompressedRecord, raw: np.ndarray, codes: np.ndarray, lanes: np.ndarray,
                 checksum: Checksum) -> tuple[CompressedRecord, dict[Part, np.ndarray]]:
    record = replace(record, num_codes=int(codes.size))
    code_bytes = codes.astype("<u2").view(np.uint8)
    offsets = lane_offsets(lanes)
    checks = np.zeros((record.num_chunks, NUM_CHECKS), np.uint32)
    for chunk in range(record.num_chunks):
        lo, hi, c0, c1 = chunk_bounds(record, offsets, chunk)
        checks[chunk] = (checksum(code_bytes[2 * c0:2 * c1]), checksum(raw[lo:hi]))
    return record, {Part.CHECKS: checks, Part.LANES: lanes, Part.CODES: code_bytes, Part.RAW: raw}


def compress_file(src: Path, dst: Path, cast: CastDtype | None,
                  on_tensor: Callable[[TensorStats], None] | None = None,
                  version: str = FORMAT_VERSION) -> list[TensorStats]:
    """Compress one safetensors file into a safetensors file with FORMAT_KEY in its metadata (`version`:
    an older readable format, for compatibility tests only).

    Parts are ordered by alignment (uint32 checks, then uint16 lanes, then codes, then plain tensors,
    then raw bytes) so the reader's views are aligned and all lane tables are read in one pass.
    """
    records: dict[str, Record] = {}
    aligned4: list[Entry] = []
    lanes_parts: list[Entry] = []
    codes_parts: list[Entry] = []
    plain: list[Entry] = []
    raw_parts: list[Entry] = []
    stats: list[TensorStats] = []
    pending: list[tuple[str, torch.Tensor, FloatKind]] = []
    shared: list[SharedBook] = []
    checksum = DATA_CHECKSUMS[version]

    def flush() -> None:
        if not pending:
            return
        results = compress_tensors([(tensor, kind) for _, tensor, kind in pending], shared, checksum)
        for (name, tensor, _), (record, parts) in zip(pending, results, strict=True):
            records[name] = record
            aligned4.append(numpy_entry(part_name(name, Part.CHECKS), parts[Part.CHECKS]))
            lanes_parts.append(numpy_entry(part_name(name, Part.LANES), parts[Part.LANES]))
            codes_parts.append(numpy_entry(part_name(name, Part.CODES), parts[Part.CODES]))
            raw_parts.append(numpy_entry(part_name(name, Part.RAW), parts[Part.RAW]))
            original = tensor.numel() * tensor.element_size()
            report(TensorStats(name, original, sum(p.nbytes for p in parts.values()), compressed=True))
        pending.clear()

    def report(stat: TensorStats) -> None:
        stats.append(stat)
        if on_tensor is not None:
            on_tensor(stat)

    with safe_open(str(src), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
            tensor = f.get_tensor(name)
            if cast is not None and tensor.is_floating_point():
                tensor = tensor.to(cast.torch_dtype)
            kind = compressible_kind(tensor)
            if kind is None:
                entry = torch_entry(name, tensor)
                records[name] = PlainRecord(checksum=checksum(entry.data))
                plain.append(entry)
                report(TensorStats(name, entry.data.nbytes, entry.data.nbytes, compressed=False))
                continue
            pending.append((name, tensor, kind))
            if sum(t.numel() for _, t, _ in pending) >= _BATCH_SYMBOLS:
                flush()
        flush()
    metadata = {FORMAT_KEY: version, TENSORS_KEY: records_to_json(records)}
    write_safetensors(dst, aligned4 + lanes_parts + codes_parts + plain + raw_parts, metadata)
    return stats


def compress_folder(src: Path | str, dst: Path | str, cast: CastDtype | None = None,
                    on_tensor: Callable[[TensorStats], None] | None = None) -> list[TensorStats]:
    """Compress every *.safetensors file of an HF folder into `dst`; copy every other file as is."""
    src, dst = Path(src), Path(dst)
    weight_files = sorted(src.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{src}: no *.safetensors files to compress")
    if dst.resolve() == src.resolve():
        raise ValueError("destination must differ from the source folder")
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix == ".safetensors":
            continue
        target = dst / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target)
    stats: list[TensorStats] = []
    for file in weight_files:
        stats += compress_file(file, dst / file.name, cast, on_tensor)
    return stats
