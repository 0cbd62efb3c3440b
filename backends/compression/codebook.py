"""The entropy code of the exponent stream: a variable-to-fixed (Tunstall-style) dictionary.

Each 16-bit codeword stands for a string of 1..8 exponent symbols, so every codeword sits at a
fixed position and decoding needs no sequential bit parsing (gather, prefix sum, scatter: fast in
numpy and trivially parallel on a GPU). The dictionary is rebuilt from the per-tensor symbol counts
and a threshold, so the file stores ~1 KB per tensor instead of the 576 KB table. numpy, with the C
extension's loops where it is built (the same results); no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.compression.layout import MAX_WORD_SYMBOLS
from backends.compression.native import native

MAX_CODEWORDS = 1 << 16          # codewords are uint16
_END_OF_LANE = 1 << 10           # pad rank: larger than any word's child count, so parses stop
_SEARCH_STEPS = 16               # bisection steps on log(threshold): ends a factor 1.0008 apart


@dataclass(frozen=True, slots=True)
class Codebook:
    symbols: np.ndarray      # [A] uint8: the alphabet, most probable first (ties: smaller value first)
    payload: np.ndarray      # [K] uint64: word k's symbols, the first in the lowest byte, rest zero
    lengths: np.ndarray      # [K] uint8: number of symbols in word k (1..8)
    first_child: np.ndarray  # [K] int64: id of word k's first child (children follow in alphabet order)
    num_children: np.ndarray # [K] int64: how many children word k has (0 for a leaf)

    @property
    def num_words(self) -> int:
        return int(self.lengths.size)


def alphabet_probabilities(symbols: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort the used symbols by count (desc, ties by value) and return (symbols, probabilities)."""
    keep = counts > 0
    symbols, counts = symbols[keep], counts[keep].astype(np.int64)
    order = np.lexsort((symbols, -counts))
    symbols, counts = symbols[order], counts[order]
    return symbols.astype(np.uint8), counts.astype(np.float64) / float(counts.sum())


def _levels(probs: np.ndarray, threshold: float,
            max_words: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """The dictionary's levels as (parent index in previous level, symbol rank, probability).

    A word of depth d+1 exists when its parent exists and p[rank] >= threshold / p(parent): since
    `probs` is sorted descending, each parent's children are the first `cnt` ranks. Every float
    operation here is a correctly rounded IEEE op, so the build is identical on every platform.
    Returns None as soon as the count passes `max_words`.
    """
    num = probs.size
    levels = [(np.full(num, -1, np.int64), np.arange(num, dtype=np.int64), probs)]
    total = num
    neg = -probs
    for _ in range(MAX_WORD_SYMBOLS - 1):
        parent_probs = levels[-1][2]
        cnt = np.searchsorted(neg, -(threshold / parent_probs), side="right")  # [level size]
        n_next = int(cnt.sum())
        if n_next == 0:
            break
        total += n_next
        if total > max_words:
            return None
        parent = np.repeat(np.arange(parent_probs.size, dtype=np.int64), cnt)
        starts = np.cumsum(cnt) - cnt
        rank = np.arange(n_next, dtype=np.int64) - np.repeat(starts, cnt)
        levels.append((parent, rank, parent_probs[parent] * probs[rank]))
    return levels


def _fits(probs: np.ndarray, threshold: float, max_words: int) -> bool:
    """Whether the dictionary for `threshold` has at most `max_words` words (built in C when it can be:
    the same words, ~20x faster)."""
    if native is not None and max_words == MAX_CODEWORDS:
        payload, lengths = np.empty(MAX_CODEWORDS, np.uint64), np.empty(MAX_CODEWORDS, np.uint8)
        probs = np.ascontiguousarray(probs, np.float64)
        return native.build_tables(probs, np.zeros(probs.size, np.uint8), float(threshold), payload, lengths) >= 0
    return _levels(probs, threshold, max_words) is not None


def choose_threshold(probs: np.ndarray, max_words: int = MAX_CODEWORDS) -> float:
    """The smallest threshold (bisected in log space) whose dictionary has at most `max_words` words."""
    if _fits(probs, 0.0, max_words):
        return 0.0  # the complete tree of depth 8 fits (tiny alphabets)
    # hi always fits (at most 100 words per level have p >= 1e-2); lo = 1e-9 << 1 / MAX_CODEWORDS
    lo, hi = np.log(1e-9), np.log(1e-2)
    for _ in range(_SEARCH_STEPS):
        mid = (lo + hi) / 2
        if not _fits(probs, float(np.exp(mid)), max_words):
            lo = mid
        else:
            hi = mid
    return float(np.exp(hi))


def build_codebook(symbols: np.ndarray, probs: np.ndarray, threshold: float, links: bool = True) -> Codebook:
    """Build the dictionary (words in breadth-first order) for sorted `symbols`/`probs` and `threshold`.
    links=False (decoders) leaves first_child/num_children empty: only the encoder walks the tree."""
    levels = _levels(probs, threshold, MAX_CODEWORDS)
    if levels is None:
        raise ValueError(f"threshold {threshold!r} gives more than {MAX_CODEWORDS} codewords")
    sizes = [lvl[0].size for lvl in levels]
    offsets = np.cumsum([0, *sizes])
    total = int(offsets[-1])
    payload = np.zeros(total, np.uint64)
    lengths = np.zeros(total, np.uint8)
    first_child = np.zeros(total if links else 0, np.int64)
    num_children = np.zeros(total if links else 0, np.int64)
    sym64 = symbols.astype(np.uint64)
    for depth, (parent, rank, _) in enumerate(levels):
        lo, hi = offsets[depth], offsets[depth + 1]
        value = sym64[rank] << np.uint64(8 * depth)
        if depth > 0:
            value |= payload[offsets[depth - 1] + parent]
        if depth > 0 and links:
            counts = np.bincount(parent, minlength=sizes[depth - 1])
            num_children[offsets[depth - 1]:lo] = counts
            first_child[offsets[depth - 1]:lo] = lo + np.cumsum(counts) - counts
        payload[lo:hi] = value
        lengths[lo:hi] = depth + 1
    return Codebook(symbols, payload, lengths, first_child, num_children)


def expected_word_length(book: Codebook, probs256: np.ndarray) -> float:
    """Estimated symbols per codeword when `book` parses a memoryless source with symbol probabilities
    `probs256` ([256], indexed by symbol value): sum of P(w) over the words, the probability that the
    input at a word boundary starts with w. Exact for a complete tree; an upper bound a few percent
    high here, since a word ends on a symbol that is not one of its children and that symbol starts
    the next word. Used to compare dictionaries on one tensor, where the bias largely cancels."""
    word_probs = np.ones(book.num_words)
    symbol_bytes = book.payload.view(np.uint8).reshape(-1, 8)       # [K, 8], first symbol first
    for j in range(MAX_WORD_SYMBOLS):
        word_probs *= np.where(book.lengths > j, probs256[symbol_bytes[:, j]], 1.0)
    return float(word_probs.sum())


def encode(ranks: np.ndarray, book: Codebook, lane_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy longest-match parse of one symbol stream; see encode_many."""
    return encode_many([(ranks, book)], lane_size)[0]


def encode_many(streams: list[tuple[np.ndarray, Codebook]], lane_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Greedy longest-match parse of each (alphabet ranks, dictionary) stream, restarted every
    `lane_size` symbols: in C one stream at a time, else every lane of every stream in lockstep over
    the concatenated dictionaries, so the Python loop runs ~lane_size / mean word length times in all
    and numpy's per-call overhead is paid once for many tensors.
    Returns, per stream, (codewords uint16 in lane order, codewords per lane uint16).
    """
    if native is not None:
        return [_encode_native(ranks, book, lane_size) for ranks, book in streams]
    word_base = np.cumsum([0] + [book.num_words for _, book in streams])
    # word_base has one entry more than streams: the end of the last dictionary
    first_child = np.concatenate([book.first_child + base
                                  for (_, book), base in zip(streams, word_base, strict=False)])
    num_children = np.concatenate([book.num_children for _, book in streams]).astype(np.int32)
    lanes_per_stream = [-(-ranks.size // lane_size) for ranks, _ in streams]
    width = lane_size + MAX_WORD_SYMBOLS          # each lane padded with a rank no word has as child
    padded = np.full((sum(lanes_per_stream), width), _END_OF_LANE, np.int32)  # [lanes, width]
    lane_base = np.repeat(word_base[:-1], lanes_per_stream).astype(np.int64)
    row = 0
    for (ranks, _), num_lanes in zip(streams, lanes_per_stream, strict=True):
        lanes = np.full(num_lanes * lane_size, _END_OF_LANE, np.int32)
        lanes[:ranks.size] = ranks
        padded[row:row + num_lanes, :lane_size] = lanes.reshape(num_lanes, lane_size)
        row += num_lanes
    lane_len = np.concatenate([np.minimum(lane_size, ranks.size - np.arange(n) * lane_size)
                               for (ranks, _), n in zip(streams, lanes_per_stream, strict=True)])
    flat = padded.reshape(-1)
    cur = np.arange(padded.shape[0], dtype=np.int64) * width       # flat position of each lane's parse
    end = cur + lane_len
    rows: list[np.ndarray] = []
    while True:
        active = cur < end
        if not active.any():
            break
        node = np.where(active, flat[cur], 0) + lane_base
        length = np.ones(cur.size, np.int64)
        alive = active.copy()
        for depth in range(1, MAX_WORD_SYMBOLS):
            s = flat[cur + depth]
            alive &= s < num_children[node]
            node = np.where(alive, first_child[node] + s, node)
            length += alive
        rows.append(np.where(active, node - lane_base, -1).astype(np.int32))
        cur = np.where(active, cur + length, cur)
    table = np.stack(rows, axis=1) if rows else np.zeros((cur.size, 0), np.int64)  # [lanes, steps]
    out = []
    row = 0
    for num_lanes in lanes_per_stream:
        part = table[row:row + num_lanes]
        valid = part >= 0
        out.append((part[valid].astype(np.uint16), valid.sum(axis=1).astype(np.uint16)))
        row += num_lanes
    return out


def _encode_native(ranks: np.ndarray, book: Codebook, lane_size: int) -> tuple[np.ndarray, np.ndarray]:
    assert native is not None   # encode_many calls this only when the extension is built
    ranks = np.ascontiguousarray(ranks, np.uint8)
    codes = np.empty(ranks.size, np.uint16)
    lanes = np.empty(-(-ranks.size // lane_size), np.uint16)
    num_codes = native.encode_lanes(ranks, np.ascontiguousarray(book.first_child, np.int64),
                                    np.ascontiguousarray(book.num_children, np.int64), lane_size, codes, lanes)
    if num_codes < 0:
        raise ValueError("symbol ranks outside the dictionary")
    return codes[:num_codes].copy(), lanes
