"""What a compressed tensor looks like on disk: names of its parts, its metadata record, the
split of a 16-bit float into an entropy-coded symbol byte and a raw byte, and the checksums.

Pure: numpy and json only, no file I/O (container.py reads and writes files).
"""
from __future__ import annotations

import enum
import json
import math
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import crc32c
import numpy as np

FORMAT_KEY = "switchyard.format"          # metadata key the loader keys on
FORMAT_VERSION = "switchyard-tunstall16-v3"
# The checksum of data (chunks, plain tensors) by format: v3 has CRC-32C, hardware-accelerated at
# ~18 GB/s here against zlib's crc32 at ~3.7 (which cost ~15% of a v2 decode). v2 files still load.
Checksum = Callable[[np.ndarray], int]


def _crc32(data: np.ndarray) -> int:
    return zlib.crc32(data.data)


def _crc32c(data: np.ndarray) -> int:
    return crc32c.crc32c(data.data)


CRC32C: Checksum = _crc32c                # the C decoder computes the same one itself (_native.c)
DATA_CHECKSUMS: dict[str, Checksum] = {
    "switchyard-tunstall16-v2": _crc32,
    FORMAT_VERSION: CRC32C,
}
TENSORS_KEY = "switchyard.tensors"        # metadata key: JSON {name: record}
LANE_SIZE = 1024                          # symbols per independently parsed lane (one GPU program)
LANES_PER_CHUNK = 256                     # lanes per checksummed chunk (one CPU work item)
PART_SEPARATOR = "::"
MAX_WORD_SYMBOLS = 8             # at most this many symbols per codeword (one uint64 payload)


class FloatKind(enum.Enum):
    """16-bit float types that are compressed, and how each splits into symbol + raw byte."""
    BF16 = "BF16"   # symbol: the 8 exponent bits; raw: sign << 7 | 7 mantissa bits
    FP16 = "F16"    # symbol: the high byte (sign, 5 exponent bits, 2 mantissa bits); raw: low byte


class Part(enum.Enum):
    """The uint8/uint16/uint32 tensors that make up one compressed tensor in the file."""
    CODES = "codes"    # uint8 [2 * num_codes]: little-endian uint16 codewords, lane after lane
    RAW = "raw"        # uint8 [numel]: the raw byte of every element, in element order
    LANES = "lanes"    # uint16 [num_lanes]: codewords in each lane
    CHECKS = "checks"  # uint32 [num_chunks, 2]: checksums of codes and of raw bytes per chunk


NUM_CHECKS = 2   # columns of Part.CHECKS: checksum of the chunk's codeword bytes, of its raw bytes


def part_name(name: str, part: Part) -> str:
    return f"{name}{PART_SEPARATOR}{part.value}"


@dataclass(frozen=True, slots=True)
class CompressedRecord:
    kind: FloatKind            # the tensor's dtype
    shape: tuple[int, ...]     # the tensor's shape
    alphabet: tuple[int, ...]  # dictionary's symbol values, most probable first (ties: smaller value first)
    counts: tuple[int, ...]    # symbol counts the dictionary is built from: this tensor's, or those of an
                               # earlier tensor of the file whose dictionary it shares (same four fields)
    threshold: float           # dictionary threshold (see codebook.build_codebook)
    book_checksum: int         # adler32 of the rebuilt dictionary's payload and lengths
    num_codes: int             # codewords in the stream
    lane_size: int = LANE_SIZE
    lanes_per_chunk: int = LANES_PER_CHUNK

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_lanes(self) -> int:
        return -(-self.numel // self.lane_size)

    @property
    def chunk_size(self) -> int:
        return self.lane_size * self.lanes_per_chunk

    @property
    def num_chunks(self) -> int:
        return -(-self.numel // self.chunk_size)


@dataclass(frozen=True, slots=True)
class PlainRecord:
    checksum: int              # data checksum of the tensor's bytes as stored


Record = CompressedRecord | PlainRecord


def _canonical(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def records_to_json(records: dict[str, Record]) -> str:
    """Serialize records; each carries a crc32 of its own canonical JSON so a flipped digit is caught."""
    out = {}
    for name, rec in records.items():
        fields = asdict(rec)
        if isinstance(rec, CompressedRecord):
            fields["kind"] = rec.kind.value
        fields["type"] = "compressed" if isinstance(rec, CompressedRecord) else "plain"
        fields["crc"] = zlib.crc32(_canonical(fields).encode())
        out[name] = fields
    return json.dumps(out, separators=(",", ":"))


def records_from_json(text: str, where: str) -> dict[str, Record]:
    """Parse and verify records; raises CorruptWeightsError naming the tensor whose record is damaged."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptWeightsError(f"{where}: metadata {TENSORS_KEY!r} is not valid JSON ({exc})") from exc
    records: dict[str, Record] = {}
    for name, fields in raw.items():
        try:
            crc = fields.pop("crc")
            if zlib.crc32(_canonical(fields).encode()) != crc:
                raise ValueError("record checksum mismatch")
            kind = fields.pop("type")
            if kind == "plain":
                records[name] = PlainRecord(**fields)
            else:
                fields["kind"] = FloatKind(fields["kind"])
                for key in ("shape", "alphabet", "counts"):
                    fields[key] = tuple(fields[key])
                records[name] = CompressedRecord(**fields)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptWeightsError(f"{where}: tensor {name!r}: metadata record is corrupted ({exc})") from exc
    return records


class CorruptWeightsError(ValueError):
    """A compressed weight file is damaged; the message names the file and, where known, the tensor."""


def split_symbols(bits: np.ndarray, kind: FloatKind) -> tuple[np.ndarray, np.ndarray]:
    """[n] uint16 float bits -> ([n] uint8 symbols, [n] uint8 raw bytes)."""
    if kind is FloatKind.BF16:
        symbols = ((bits >> 7) & 0xFF).astype(np.uint8)
        raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    else:
        symbols = (bits >> 8).astype(np.uint8)
        raw = (bits & 0xFF).astype(np.uint8)
    return symbols, raw


def book_checksum(payload: np.ndarray, lengths: np.ndarray) -> int:
    return zlib.adler32(lengths.data, zlib.adler32(payload.data))


def lane_offsets(lanes: np.ndarray) -> np.ndarray:
    """[num_lanes] codewords per lane -> [num_lanes + 1] int64 codeword offset of each lane."""
    out = np.zeros(lanes.size + 1, np.int64)
    np.cumsum(lanes, out=out[1:])
    return out


def chunk_bounds(record: CompressedRecord, offsets: np.ndarray, chunk: int) -> tuple[int, int, int, int]:
    """(first element, end element, first codeword, end codeword) of chunk `chunk`."""
    lo = chunk * record.chunk_size
    hi = min(lo + record.chunk_size, record.numel)
    lane_lo = chunk * record.lanes_per_chunk
    lane_hi = min(lane_lo + record.lanes_per_chunk, record.num_lanes)
    return lo, hi, int(offsets[lane_lo]), int(offsets[lane_hi])
