"""The dictionary code on its own: size limits, prefix-closure, exact parse, and the bound on its length."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from backends.compression import codebook
from backends.compression.cpu_decode import expand_codes
from backends.compression.layout import MAX_WORD_SYMBOLS


def _book_for(symbols: np.ndarray) -> codebook.Codebook:
    counts = np.bincount(symbols, minlength=256)
    alphabet, probs = codebook.alphabet_probabilities(np.arange(256), counts)
    return codebook.build_codebook(alphabet, probs, codebook.choose_threshold(probs))


def _roundtrip(symbols: np.ndarray, lane_size: int) -> tuple[np.ndarray, codebook.Codebook]:
    book = _book_for(symbols)
    rank_of = np.zeros(256, np.int64)
    rank_of[book.symbols] = np.arange(book.symbols.size)
    codes, lanes = codebook.encode(rank_of[symbols], book, lane_size)
    assert int(lanes.sum()) == codes.size
    decoded = expand_codes(codes, book.payload, book.lengths, symbols.size)
    assert decoded is not None
    np.testing.assert_array_equal(decoded, symbols)
    return codes, book


@pytest.mark.parametrize("name, symbols", [
    ("one symbol", np.full(5000, 127, np.uint8)),
    ("two symbols", np.array([3, 200] * 2500, np.uint8)),
    ("uniform 256", np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint8)),
    ("geometric", np.minimum(np.random.default_rng(1).geometric(0.4, 50_000) + 110, 255).astype(np.uint8)),
    ("one rare", np.where(np.random.default_rng(2).random(30_000) < 1e-4, 0, 120).astype(np.uint8)),
])
def test_roundtrip_table(name: str, symbols: np.ndarray) -> None:
    _codes, book = _roundtrip(symbols, lane_size=1024)
    assert book.num_words <= codebook.MAX_CODEWORDS
    assert book.lengths.min() >= 1 and book.lengths.max() <= MAX_WORD_SYMBOLS


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=3000), st.sampled_from([1, 7, 64, 1024]))
def test_roundtrip_property(values: list[int], lane_size: int) -> None:
    _roundtrip(np.array(values, np.uint8), lane_size)


def test_dictionary_is_prefix_closed_and_complete_at_depth_one() -> None:
    book = _book_for(np.random.default_rng(3).geometric(0.3, 40_000).astype(np.uint8))
    num_symbols = book.symbols.size
    np.testing.assert_array_equal(book.lengths[:num_symbols], 1)   # every symbol is a word: any input parses
    for word in range(book.num_words):
        first, count = int(book.first_child[word]), int(book.num_children[word])
        children = slice(first, first + count)
        assert np.all(book.lengths[children] == book.lengths[word] + 1)
        low_bytes = np.uint64((1 << (8 * int(book.lengths[word]))) - 1)
        assert np.all(book.payload[children] & low_bytes == book.payload[word])


def test_rate_is_close_to_entropy_on_weight_like_exponents() -> None:
    """Trained-weight exponents have ~2.6 bits of entropy; the code must stay within 0.2 bit of it."""
    rng = np.random.default_rng(4)
    bits = (rng.standard_normal(400_000).astype(np.float32) * 0.02).view(np.uint32) >> 16
    symbols = ((bits >> 7) & 0xFF).astype(np.uint8)
    probs = np.bincount(symbols) / symbols.size
    entropy = -(probs[probs > 0] * np.log2(probs[probs > 0])).sum()
    codes, _ = _roundtrip(symbols, lane_size=1024)
    rate = codes.size * 16 / symbols.size
    assert entropy <= rate <= entropy + 0.2, (entropy, rate)


def test_build_is_deterministic_from_counts_and_threshold() -> None:
    symbols = np.random.default_rng(5).geometric(0.35, 10_000).astype(np.uint8)
    counts = np.bincount(symbols, minlength=256)
    alphabet, probs = codebook.alphabet_probabilities(np.arange(256), counts)
    threshold = codebook.choose_threshold(probs)
    again_alphabet, again_probs = codebook.alphabet_probabilities(alphabet, counts[alphabet])
    a = codebook.build_codebook(alphabet, probs, threshold)
    b = codebook.build_codebook(again_alphabet, again_probs, threshold)
    np.testing.assert_array_equal(a.payload, b.payload)
    np.testing.assert_array_equal(a.lengths, b.lengths)


def test_expected_word_length_bounds_the_parse() -> None:
    """The mean word length the compressor uses to decide on sharing is a close upper bound of the
    real parse's (a word ends on a symbol that is not one of its children, and that symbol, more
    often a rare one, starts the next word, so real words run a few percent shorter)."""
    rng = np.random.default_rng(6)
    bits = (rng.standard_normal(300_000).astype(np.float32) * 0.05).view(np.uint32) >> 16
    symbols = ((bits >> 7) & 0xFF).astype(np.uint8)
    codes, book = _roundtrip(symbols, lane_size=1 << 20)
    predicted = codebook.expected_word_length(book, np.bincount(symbols, minlength=256) / symbols.size)
    assert 0.93 * predicted <= symbols.size / codes.size <= predicted


def test_codewords_past_the_dictionary_or_wrong_lengths_are_refused() -> None:
    book = _book_for(np.random.default_rng(7).geometric(0.3, 10_000).astype(np.uint8))
    past = np.array([book.num_words], np.uint16) if book.num_words < codebook.MAX_CODEWORDS else None
    if past is not None:
        assert expand_codes(past, book.payload, book.lengths, int(book.lengths.max())) is None
    assert expand_codes(np.zeros(3, np.uint16), book.payload, book.lengths, 4) is None   # 3 symbols, not 4
