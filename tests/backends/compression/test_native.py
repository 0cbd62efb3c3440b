"""The C decoder (`backends/compression/_native.c`): built by `make setup`, the same bits as the numpy
path and as the weights it was given, and a refusal (never a write out of bounds) on bad codewords."""
from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save_file

from backends.compression import CorruptWeightsError, codebook, compress_folder, cpu_decode, load_compressed_file
from backends.compression.compress import compress_file
from backends.compression.container import map_file
from backends.compression.cpu_decode import Scratch, decode_tables, expand_into, merge_into, native_decoder
from backends.compression.layout import DATA_CHECKSUMS, FORMAT_KEY, FORMAT_VERSION, FloatKind, split_symbols
from tests.backends.compression.test_codebook import _book_for

KINDS = {FloatKind.BF16: 0, FloatKind.FP16: 1}


def test_extension_is_built() -> None:
    assert native_decoder is not None, (
        "backends.compression._native is missing: `pip install -e .` needs a C compiler and Python headers "
        "to build it; without them weights decode with numpy at about a third of the speed")


needs_native = pytest.mark.skipif(native_decoder is None, reason="C decoder not built")


def _encoded(bits: np.ndarray, kind: FloatKind):
    symbols, raw = split_symbols(bits, kind)
    book = _book_for(symbols)
    rank_of = np.zeros(256, np.int64)
    rank_of[book.symbols] = np.arange(book.symbols.size)
    codes, _ = codebook.encode(rank_of[symbols], book, 1024)
    return codes.astype("<u2"), decode_tables(book.payload, book.lengths), raw


def _native(codes: np.ndarray, tables, raw: np.ndarray, kind: FloatKind, out: np.ndarray) -> bool:
    return native_decoder.decode_chunk(codes, tables.payload, tables.lengths, tables.num_words, raw, out, KINDS[kind])


@st.composite
def float_bits(draw: st.DrawFn) -> np.ndarray:
    """16-bit float patterns whose high byte follows an adversarial distribution; sizes cross the C
    decoder's 4096-symbol blocks."""
    n = draw(st.sampled_from([1, 7, 4095, 4096, 4097, 8192, 20_011]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = draw(st.sampled_from(["single", "all 256", "geometric", "two", "rare"]))
    if shape == "single":
        high = np.full(n, rng.integers(0, 256), np.uint16)
    elif shape == "all 256":
        high = rng.integers(0, 256, n).astype(np.uint16)
    elif shape == "geometric":
        high = np.minimum(rng.geometric(0.35, n) + 100, 255).astype(np.uint16)
    elif shape == "two":
        high = rng.choice(np.array([0, 255], np.uint16), n)
    else:
        high = np.where(rng.random(n) < 1e-3, 0x7F, 0x3C).astype(np.uint16)
    return (high << 8) | rng.integers(0, 256, n).astype(np.uint16)


@needs_native
@settings(max_examples=60, deadline=None)
@given(bits=float_bits(), kind=st.sampled_from(list(FloatKind)))
def test_native_gives_the_original_bits_and_matches_numpy(bits: np.ndarray, kind: FloatKind) -> None:
    codes, tables, raw = _encoded(bits, kind)
    out = np.empty(bits.size, np.uint16)
    assert _native(codes, tables, raw, kind, out)
    np.testing.assert_array_equal(out, bits)
    scratch = Scratch(codes.size, bits.size)
    via_numpy = np.empty(bits.size, np.uint16)
    merge_into(via_numpy, expand_into(codes.view(np.uint16), tables, bits.size, scratch), raw, kind, scratch)
    np.testing.assert_array_equal(via_numpy, out)


@needs_native
def test_native_refuses_bad_codewords_without_writing_past_the_output() -> None:
    rng = np.random.default_rng(3)
    exponents = rng.choice(np.array([120, 121, 122], np.uint16), 10_000, p=[0.7, 0.2, 0.1])
    bits = (exponents << 7) | rng.integers(0, 128, 10_000).astype(np.uint16)
    codes, tables, raw = _encoded(bits, FloatKind.BF16)
    assert tables.num_words < 65536                               # three symbols: a small dictionary
    guard = np.full(bits.size + 64, 0xABCD, np.uint16)
    out = guard[:bits.size]
    outside = codes.copy()
    outside[len(outside) // 2] = tables.num_words               # one past the dictionary
    assert not _native(outside, tables, raw, FloatKind.BF16, out)
    assert not _native(codes[:-1], tables, raw, FloatKind.BF16, out)                    # too few symbols
    longest = np.array([int(np.argmax(tables.lengths))] * 64, "<u2")
    assert not _native(np.concatenate([codes, longest]), tables, raw, FloatKind.BF16, out)   # too many
    assert (guard[bits.size:] == 0xABCD).all()
    assert _native(codes, tables, raw, FloatKind.BF16, out)
    np.testing.assert_array_equal(out, bits)


@needs_native
def test_native_rejects_mismatched_buffers() -> None:
    tables = decode_tables(np.arange(4, dtype=np.uint64), np.ones(4, np.uint8))
    codes, raw, out = np.zeros(4, "<u2"), np.zeros(4, np.uint8), np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="65536"):
        native_decoder.decode_chunk(codes, tables.payload[:100], tables.lengths, 4, raw, out, 0)
    with pytest.raises(ValueError, match="one 16-bit value per raw byte"):
        native_decoder.decode_chunk(codes, tables.payload, tables.lengths, 4, raw, out[:3], 0)
    with pytest.raises(ValueError, match="kind"):
        native_decoder.decode_chunk(codes, tables.payload, tables.lengths, 4, raw, out, 2)
    with pytest.raises(ValueError, match="num_words"):
        native_decoder.decode_chunk(codes, tables.payload, tables.lengths, 65537, raw, out, 0)
    with pytest.raises(TypeError):
        native_decoder.decode_chunk(codes, tables.payload, tables.lengths, 4, raw, bytes(8), 0)   # read-only out


@pytest.fixture(scope="module")
def source_folder(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("native")
    gen = torch.Generator().manual_seed(5)
    weights = {
        "big.weight": (torch.randn(700, 1000, generator=gen) * 0.02).to(torch.bfloat16),   # 3 chunks
        "half.weight": (torch.randn(300, 257, generator=gen) * 0.1).to(torch.float16),
        "norm.weight": torch.ones(64, dtype=torch.float32),
    }
    (root / "src").mkdir()
    save_file(weights, str(root / "src" / "model.safetensors"))
    return root, weights


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_both_paths_load_a_file_bit_exact(source_folder, native: bool) -> None:
    root, weights = source_folder
    compress_folder(root / "src", root / "dst")
    got = load_compressed_file(root / "dst" / "model.safetensors", native=native)
    for name, tensor in weights.items():
        assert torch.equal(got[name].view(torch.int16) if tensor.dtype != torch.float32 else got[name],  # lossless
                           tensor.view(torch.int16) if tensor.dtype != torch.float32 else tensor), name


def test_v2_files_with_zlib_checksums_still_load_and_are_checked(source_folder, tmp_path) -> None:
    root, weights = source_folder
    v2 = "switchyard-tunstall16-v2"
    assert v2 != FORMAT_VERSION and DATA_CHECKSUMS[v2] is not DATA_CHECKSUMS[FORMAT_VERSION]
    path = tmp_path / "v2.safetensors"
    compress_file(root / "src" / "model.safetensors", path, None, version=v2)
    assert map_file(path).metadata[FORMAT_KEY] == v2
    got = load_compressed_file(path)
    assert torch.equal(got["big.weight"].view(torch.int16), weights["big.weight"].view(torch.int16))   # lossless
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x5A                     # the last tensor's raw bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError, match="fails its checksum"):
        load_compressed_file(path)


@st.composite
def symbol_counts(draw: st.DrawFn) -> np.ndarray:
    """[256] symbol counts: one symbol, a handful, or a skewed spread over many (ties included)."""
    size = draw(st.sampled_from([1, 2, 3, 5, 22, 60, 256]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    counts = np.zeros(256, np.int64)
    used = rng.choice(256, size, replace=False)
    counts[used] = np.maximum(1, (rng.pareto(draw(st.sampled_from([0.5, 1.0, 3.0])), size) * 1000).astype(np.int64))
    if size > 3 and draw(st.booleans()):
        counts[used[1]] = counts[used[0]]                      # a tie
    return counts


@needs_native
@settings(max_examples=80, deadline=None)
@given(counts=symbol_counts())
def test_native_dictionary_equals_the_numpy_build(counts: np.ndarray) -> None:
    symbols, probs = codebook.alphabet_probabilities(np.arange(256), counts)
    chosen = codebook.choose_threshold(probs)
    outcomes = set()
    for threshold in (chosen, chosen / 4, chosen / 64):    # smaller thresholds may give too many words
        try:
            want = cpu_decode.build_tables(symbols, probs, threshold, native=False)
        except ValueError:
            with pytest.raises(ValueError, match="more than 65536"):
                cpu_decode.build_tables(symbols, probs, threshold, native=True)
            outcomes.add("refused")
            continue
        got = cpu_decode.build_tables(symbols, probs, threshold, native=True)
        assert got.num_words == want.num_words <= 65536
        np.testing.assert_array_equal(got.lengths, want.lengths)
        np.testing.assert_array_equal(got.payload, want.payload)
        outcomes.add("built")
    assert "built" in outcomes


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=symbol_counts(), size=st.sampled_from([1, 5, 1023, 1024, 1025, 5000]),
       lane_size=st.sampled_from([1, 3, 64, 1024]), seed=st.integers(0, 2**32 - 1))
def test_native_encoder_and_threshold_equal_the_numpy_ones(counts: np.ndarray, size: int, lane_size: int, seed: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    symbols, probs = codebook.alphabet_probabilities(np.arange(256), counts)
    ranks = np.random.default_rng(seed).choice(symbols.size, size, p=probs)
    threshold = codebook.choose_threshold(probs)
    book = codebook.build_codebook(symbols, probs, threshold)
    codes, lanes = codebook.encode(ranks, book, lane_size)
    with monkeypatch.context() as patch:
        patch.setattr(codebook, "native", None)
        assert codebook.choose_threshold(probs) == threshold
        want_codes, want_lanes = codebook.encode(ranks, book, lane_size)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(lanes, want_lanes)
    decoded = cpu_decode.expand_codes(codes, book.payload, book.lengths, size)
    np.testing.assert_array_equal(decoded, symbols[ranks])


def test_compressed_files_are_identical_with_and_without_the_extension(source_folder, tmp_path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = source_folder
    compress_folder(root / "src", tmp_path / "native")
    monkeypatch.setattr(codebook, "native", None)
    compress_folder(root / "src", tmp_path / "numpy")
    # exact: the C dictionary builder repeats numpy's elementwise IEEE double operations (built with
    # -ffp-contract=off: no fused multiply-adds on any CPU), and the rest is integer work
    native, numpy = tmp_path / "native" / "model.safetensors", tmp_path / "numpy" / "model.safetensors"
    assert native.read_bytes() == numpy.read_bytes()


def test_parts_lie_in_the_documented_order(source_folder, tmp_path) -> None:
    """checks, lanes, codes, plain tensors, raw bytes (docs/compression.md, "Data order")."""
    root, _ = source_folder
    compress_folder(root / "src", tmp_path / "out")
    spans = map_file(tmp_path / "out" / "model.safetensors").spans
    order = {"checks": 0, "lanes": 1, "codes": 2, "raw": 4}
    rank = {name: order.get(name.rsplit("::", 1)[1], 3) if "::" in name else 3 for name in spans}
    by_offset = sorted(spans, key=lambda name: spans[name][2])
    assert [rank[name] for name in by_offset] == sorted(rank[name] for name in by_offset)
    assert {rank[name] for name in spans} == {0, 1, 2, 3, 4}


@needs_native
@pytest.mark.parametrize("table", [False, True])
def test_c_crc32c_is_the_packages(table: bool) -> None:
    """decode_chunks checks chunks with its own CRC-32C: the SSE4.2 instruction here, the byte-wise
    table on other CPUs; both must give the `crc32c` package's values (the compressor's)."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 70_000, dtype=np.uint8)
    for size in (0, 1, 7, 8, 9, 63, 4096, 65_537):
        for offset in (0, 1, 5):
            piece = data[offset:offset + size]
            assert native_decoder.crc32c(piece, table) == crc32c.crc32c(piece), (size, offset)


@needs_native
def test_decode_chunks_rejects_inconsistent_layouts() -> None:
    tables = decode_tables(np.arange(4, dtype=np.uint64), np.ones(4, np.uint8))
    codes, raw, out = np.zeros(8, "<u2"), np.zeros(8, np.uint8), np.zeros(8, np.uint16)
    offsets, checks = np.array([0, 4, 8], np.int64), np.zeros(4, "<u4")    # 2 lanes, 2 chunks of 4

    def call(**changes):
        args = dict(codes=codes, payload=tables.payload, lengths=tables.lengths, num_words=4, raw=raw, out=out,
                    kind=0, offsets=offsets, lanes_per_chunk=1, chunk_size=4, checks=checks, first=0, end=2)
        args.update(changes)
        return native_decoder.decode_chunks(*args.values())

    with pytest.raises(ValueError, match="range"):
        call(end=3)
    with pytest.raises(ValueError, match="range"):
        call(first=2, end=1)
    with pytest.raises(ValueError, match="two uint32 per chunk"):
        call(checks=checks[:3])
    with pytest.raises(ValueError, match="do not cover"):
        call(lanes_per_chunk=2)
    with pytest.raises(ValueError, match="positive"):
        call(chunk_size=0)
    assert call() == 0                        # zero checksums: chunk 0's codes fail first
    good = checks.copy()
    good[0::2] = [crc32c.crc32c(codes[:4].view(np.uint8)), crc32c.crc32c(codes[4:].view(np.uint8))]
    good[1::2] = [crc32c.crc32c(raw[:4]), crc32c.crc32c(raw[4:])]
    assert call(checks=good) == -1
    np.testing.assert_array_equal(out, 0)     # codeword 0 is symbol 0, raw bytes 0
    good[3] ^= 1
    assert call(checks=good) == 3 * 1 + 1     # chunk 1's raw bytes
    assert call(checks=good, end=1) == -1     # outside the range: not looked at
    wrong = np.array([0, 3, 8], np.int64)     # chunk 0 gets 3 codewords for 4 symbols
    good[0::2] = [crc32c.crc32c(codes[:3].view(np.uint8)), crc32c.crc32c(codes[3:].view(np.uint8))]
    assert call(offsets=wrong, checks=good, end=1) == 2
