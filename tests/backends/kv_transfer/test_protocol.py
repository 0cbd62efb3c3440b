"""Frame encoding, request validation, layouts and checksums, without sockets."""
from __future__ import annotations

import dataclasses
import struct
import zlib

import pytest
from hypothesis import given, strategies as st

from backends.core.kv_transfer_params import RemoteBlocks
from backends.kv_transfer.base import (
    ChecksumKind,
    KVDtype,
    KVErrorCode,
    KVLayout,
    KVTransferError,
    ReleaseMode,
    prefill_kv_transfer_params,
)
from backends.kv_transfer.protocol import (
    HEADER_SIZE,
    MAX_META_LEN,
    FrameType,
    PullRequest,
    decode_header,
    decode_layer_meta,
    encode_header,
    encode_layer_prefix,
    layer_checksum,
)

LAYOUT = KVLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=KVDtype.BFLOAT16)


def test_header_is_20_little_endian_bytes() -> None:
    raw = encode_header(FrameType.LAYER, 16, 0x0102030405)
    assert HEADER_SIZE == len(raw) == 20
    # magic, version 1, type 3, flags 0, meta_len 16 (LE u32), payload_len (LE u64)
    assert raw == b"SYKV" + bytes([1, 3, 0, 0]) + (16).to_bytes(4, "little") + (0x0102030405).to_bytes(8, "little")


@given(st.sampled_from(list(FrameType)), st.integers(0, MAX_META_LEN), st.integers(0, 2**64 - 1))
def test_header_round_trip(frame_type: FrameType, meta_len: int, payload_len: int) -> None:
    if frame_type is not FrameType.LAYER:
        payload_len = 0
    header = decode_header(encode_header(frame_type, meta_len, payload_len))
    assert (header.frame_type, header.meta_len, header.payload_len) == (frame_type, meta_len, payload_len)


@pytest.mark.parametrize("raw, needle", [
    (b"HTTP" + bytes(16), "bad magic"),
    (struct.pack("<4sBBHIQ", b"SYKV", 2, 1, 0, 0, 0), "version 2"),
    (struct.pack("<4sBBHIQ", b"SYKV", 1, 99, 0, 0, 0), "unknown frame type 99"),
    (struct.pack("<4sBBHIQ", b"SYKV", 1, 1, 0, MAX_META_LEN + 1, 0), "exceeds"),
    (struct.pack("<4sBBHIQ", b"SYKV", 1, 4, 0, 2, 8), "DONE frame with a payload"),
    (b"SYKV", "header is 4 bytes"),
])
def test_bad_headers_are_protocol_errors(raw: bytes, needle: str) -> None:
    with pytest.raises(KVTransferError) as info:
        decode_header(raw)
    assert info.value.code is KVErrorCode.PROTOCOL and needle in str(info.value)


def test_layer_prefix() -> None:
    raw = encode_layer_prefix(7, 0xDEADBEEF, 4096)
    header = decode_header(raw[:HEADER_SIZE])
    assert (header.frame_type, header.meta_len, header.payload_len) == (FrameType.LAYER, 16, 4096)
    assert decode_layer_meta(raw[HEADER_SIZE:]) == (7, 0xDEADBEEF)


def test_pull_request_round_trip() -> None:
    req = PullRequest("t-1", LAYOUT, ChecksumKind.CRC32C, ReleaseMode.ON_SEND, start_block=2, num_blocks=5)
    assert PullRequest.from_wire(req.to_wire()) == req


@pytest.mark.parametrize("patch, needle", [
    ({"transfer_id": ""}, "transfer_id"),
    ({"transfer_id": 5}, "transfer_id"),
    ({"num_blocks": -1}, "num_blocks"),
    ({"start_block": 1.5}, "start_block"),
    ({"checksum": "md5"}, "md5"),
    ({"release": "sometimes"}, "sometimes"),
    ({"layout": {"num_layers": 1}}, "layout"),
    ({"layout": {**LAYOUT.to_wire(), "dtype": "int4"}}, "int4"),
    ({"layout": {**LAYOUT.to_wire(), "head_dim": 0}}, "positive"),
    ({"layout": {**LAYOUT.to_wire(), "head_dim": True}}, "positive"),
])
def test_bad_pull_requests_name_the_field(patch: dict[str, object], needle: str) -> None:
    wire = {**PullRequest("t", LAYOUT, ChecksumKind.NONE, ReleaseMode.NEVER, 0, 1).to_wire(), **patch}
    with pytest.raises(ValueError) as info:
        PullRequest.from_wire(wire)
    assert needle in str(info.value)


def test_layout_mismatch_names_every_differing_field() -> None:
    other = KVLayout(num_layers=30, block_size=32, num_kv_heads=3, head_dim=64, dtype=KVDtype.FLOAT16)
    assert LAYOUT.mismatch(LAYOUT) is None
    assert LAYOUT.mismatch(other) == ("block_size: 16 here vs 32 at the peer; "
                                      "dtype: bfloat16 here vs float16 at the peer")
    assert LAYOUT.block_nbytes == 16 * 3 * 64 * 2
    assert LAYOUT.layer_nbytes(10) == 2 * 10 * LAYOUT.block_nbytes


def test_layouts_compare_weights_where_both_sides_know_theirs() -> None:
    mine, theirs = (dataclasses.replace(LAYOUT, weights=w) for w in ("f00d", "beef"))
    assert mine.mismatch(theirs) == "weights: f00d here vs beef at the peer"
    assert mine.mismatch(mine) is None
    assert mine.mismatch(LAYOUT) is None and LAYOUT.mismatch(mine) is None   # a peer that sends none
    assert KVLayout.from_wire(mine.to_wire()) == mine and KVLayout.from_wire(LAYOUT.to_wire()) == LAYOUT
    assert "weights" not in LAYOUT.to_wire()
    with pytest.raises(ValueError, match="weights must be a string"):
        KVLayout.from_wire({**LAYOUT.to_wire(), "weights": 7})


def test_checksums_match_published_check_values_across_split_views() -> None:
    data = b"123456789"  # the standard CRC check input
    split = (memoryview(data[:4]), memoryview(data[4:]))
    assert layer_checksum(ChecksumKind.CRC32C, split) == 0xE3069283
    assert layer_checksum(ChecksumKind.CRC32, split) == 0xCBF43926 == zlib.crc32(data)
    import hashlib
    assert layer_checksum(ChecksumKind.BLAKE2B, split) == int.from_bytes(
        hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert layer_checksum(ChecksumKind.NONE, split) == 0


def test_kv_transfer_params_round_trip() -> None:
    params = prefill_kv_transfer_params("prefill-0", "10.0.0.5", 7100, "req-1", [4, 9, 2])
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] == [4, 9, 2]
    assert RemoteBlocks.from_params(params) == RemoteBlocks("10.0.0.5", 7100, "req-1", 3, "prefill-0")


@pytest.mark.parametrize("patch, field", [
    ({"remote_host": ""}, "remote_host"),
    ({"remote_port": "7100"}, "remote_port"),
    ({"remote_port": 70000}, "remote_port"),
    ({"remote_request_id": None}, "remote_request_id"),
    ({"remote_block_ids": [1, "2"]}, "remote_block_ids"),
    ({"remote_engine_id": 3}, "remote_engine_id"),
])
def test_bad_kv_transfer_params_name_the_field(patch: dict[str, object], field: str) -> None:
    params = {**prefill_kv_transfer_params("e", "h", 1, "t", [1]), **patch}
    with pytest.raises(ValueError) as info:
        RemoteBlocks.from_params(params)
    assert str(info.value).split()[0] == field
