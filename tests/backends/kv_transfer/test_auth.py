"""The KV listener's shared-key handshake (backends/kv_transfer/auth.py): the proof itself, table-driven, and
TcpTransport over real loopback sockets with keyed and keyless peers, raw clients and a replayed AUTH."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import torch

from backends.kv_transfer import (
    ChecksumKind,
    KVErrorCode,
    KVTransferConfig,
    KVTransferError,
    ReleaseMode,
    TcpTransport,
    auth,
)
from backends.kv_transfer.protocol import (
    HEADER_SIZE,
    FrameType,
    PullRequest,
    decode_header,
    decode_json_meta,
    encode_json_frame,
)
from backends.kv_transfer.torch_cache import TorchPagedKV
from tests.support.wait import await_until

from .conftest import assert_blocks_equal, make_kv, remote

KEY = b"pool-key-1"
SRC_IDS = [17, 3, 40]
DST_IDS = [5, 30, 2]


@pytest.mark.parametrize("key, nonce, meta, ok", [
    (KEY, b"n" * 32, {"proof": auth.proof(KEY, b"n" * 32).hex()}, True),
    (KEY, b"n" * 32, {"proof": auth.proof(b"other", b"n" * 32).hex()}, False),   # wrong key
    (KEY, b"m" * 32, {"proof": auth.proof(KEY, b"n" * 32).hex()}, False),        # another connection's nonce
    (KEY, b"n" * 32, {"proof": auth.proof(KEY, b"n" * 32).hex()[:-2]}, False),   # truncated
    (KEY, b"n" * 32, {"proof": "zz"}, False),                                    # not hex
    (KEY, b"n" * 32, {"proof": 7}, False),
    (KEY, b"n" * 32, {}, False),
])
def test_verify(key: bytes, nonce: bytes, meta: dict[str, object], ok: bool) -> None:
    assert auth.verify(key, nonce, meta) is ok


def test_the_key_never_crosses_the_wire_and_nonces_are_fresh() -> None:
    nonces = {auth.new_nonce() for _ in range(100)}
    assert len(nonces) == 100 and all(len(n) == auth.NONCE_BYTES for n in nonces)
    nonce = nonces.pop()
    frame = auth.auth_frame(KEY, {"scheme": auth.SCHEME, "nonce": nonce.hex()})
    assert KEY not in frame and KEY.hex().encode() not in frame
    assert auth.verify(KEY, nonce, decode_json_meta(FrameType.AUTH, frame[HEADER_SIZE:]))


@pytest.mark.parametrize("key, challenge, code", [
    (None, {"scheme": auth.SCHEME, "nonce": "00" * 32}, KVErrorCode.UNAUTHORIZED),
    (KEY, {"scheme": "plaintext", "nonce": "00" * 32}, KVErrorCode.PROTOCOL),
    (KEY, {"scheme": auth.SCHEME, "nonce": "00" * 8}, KVErrorCode.PROTOCOL),
    (KEY, {"scheme": auth.SCHEME, "nonce": "xyz"}, KVErrorCode.PROTOCOL),
])
def test_auth_frame_refuses_to_answer(key: bytes | None, challenge: dict[str, object], code: KVErrorCode) -> None:
    with pytest.raises(KVTransferError) as err:
        auth.auth_frame(key, challenge)
    assert err.value.code is code


class Served:
    """A keyed prefill-side cache on a loopback port, counting the refusals its listener reports."""

    def __init__(self) -> None:
        self.src = make_kv(64, torch.float32, seed=1)
        self.refused: list[str] = []
        self.transport = TcpTransport(KVTransferConfig(idle_timeout_s=2.0, key=KEY), on_refused=self.refused.append)
        self.port = 0


@pytest.fixture
async def keyed() -> AsyncIterator[Served]:
    served = Served()
    _, served.port = await served.transport.serve(served.src, "127.0.0.1", 0)
    yield served
    await served.transport.close()


async def pull(served: Served, key: bytes | None, transfer_id: str = "t") -> TorchPagedKV:
    dst = make_kv(64, torch.float32, seed=2)
    await TcpTransport(KVTransferConfig(key=key)).pull(remote(served.port, transfer_id, len(SRC_IDS)), dst, DST_IDS)
    return dst


async def test_the_right_key_pulls_and_releases(keyed: Served) -> None:
    keyed.src.holds.hold("t", SRC_IDS)
    dst = await pull(keyed, KEY)
    assert_blocks_equal(keyed.src, SRC_IDS, dst, DST_IDS)
    assert keyed.src.holds.lookup("t") is None   # the RELEASE after the pull was on the authenticated connection
    keyed.src.holds.hold("u", SRC_IDS)
    assert await TcpTransport(KVTransferConfig(key=KEY)).release(remote(keyed.port, "u"))   # its own connection
    assert keyed.refused == []


@pytest.mark.parametrize("key, reason", [(None, "missing"), (b"not-the-pool-key", "wrong")])
async def test_no_key_or_a_wrong_one_is_refused_and_the_hold_survives(keyed: Served, key: bytes | None,
                                                                      reason: str) -> None:
    keyed.src.holds.hold("t", SRC_IDS)
    with pytest.raises(KVTransferError) as err:
        await pull(keyed, key)
    assert err.value.code is KVErrorCode.UNAUTHORIZED, err.value
    with pytest.raises(KVTransferError) as err:
        await TcpTransport(KVTransferConfig(key=key)).release(remote(keyed.port, "t"))
    assert err.value.code is KVErrorCode.UNAUTHORIZED, err.value
    # The keyless client gives up on reading CHALLENGE, maybe before the listener has read its frame.
    await await_until(lambda: len(keyed.refused) == 2, "the listener to count both refusals")
    assert keyed.refused == [reason, reason]
    assert list(keyed.src.holds.lookup("t") or ()) == SRC_IDS   # neither read nor released
    dst = await pull(keyed, KEY)                   # and the pool's own pull still works
    assert_blocks_equal(keyed.src, SRC_IDS, dst, DST_IDS)


async def read_frame(reader: asyncio.StreamReader) -> tuple[FrameType, dict[str, object]]:
    header = decode_header(await reader.readexactly(HEADER_SIZE))
    return header.frame_type, decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))


def pull_frame(src: TorchPagedKV) -> bytes:
    request = PullRequest(transfer_id="t", layout=src.layout(), checksum=ChecksumKind.NONE,
                          release=ReleaseMode.NEVER, start_block=0, num_blocks=len(SRC_IDS))
    return encode_json_frame(FrameType.PULL, request.to_wire())


async def test_a_recorded_auth_does_not_open_another_connection(keyed: Served) -> None:
    """A raw client that replays the AUTH a keyed peer sent on one connection gets no block on the next: each
    connection's nonce is new. The connection is closed after the ERROR, before any PULL is read."""
    keyed.src.holds.hold("t", SRC_IDS)
    reader, writer = await asyncio.open_connection("127.0.0.1", keyed.port)
    frame_type, challenge = await read_frame(reader)
    assert frame_type is FrameType.CHALLENGE
    recorded = auth.auth_frame(KEY, challenge)
    writer.write(recorded + pull_frame(keyed.src))
    assert (await read_frame(reader))[0] is FrameType.BEGIN   # the genuine answer works
    writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", keyed.port)
    assert (await read_frame(reader))[0] is FrameType.CHALLENGE
    writer.write(recorded + pull_frame(keyed.src))
    frame_type, meta = await read_frame(reader)
    assert frame_type is FrameType.ERROR and meta["code"] == KVErrorCode.UNAUTHORIZED.value, meta
    assert await reader.read() == b""   # closed: the PULL behind the replayed AUTH was never answered
    writer.close()
    assert keyed.refused == ["wrong"]
    assert list(keyed.src.holds.lookup("t") or ()) == SRC_IDS


async def test_a_keyless_listener_serves_as_before_and_a_keyed_client_waits_for_its_challenge() -> None:
    """No key on the listener: today's protocol, no CHALLENGE. A keyed client then finds no challenge and fails
    after its idle timeout, naming what it waited for (a pool whose workers disagree on having a key)."""
    src = make_kv(64, torch.float32, seed=1)
    server = TcpTransport(KVTransferConfig(idle_timeout_s=2.0))
    _, port = await server.serve(src, "127.0.0.1", 0)
    try:
        src.holds.hold("t", SRC_IDS)
        dst = make_kv(64, torch.float32, seed=2)
        await TcpTransport().pull(remote(port, "t", len(SRC_IDS)), dst, DST_IDS)
        assert_blocks_equal(src, SRC_IDS, dst, DST_IDS)
        src.holds.hold("u", SRC_IDS)
        with pytest.raises(KVTransferError) as err:
            await TcpTransport(KVTransferConfig(key=KEY, idle_timeout_s=0.5)).pull(
                remote(port, "u", len(SRC_IDS)), dst, DST_IDS)
        assert err.value.code is KVErrorCode.TIMEOUT and "CHALLENGE" in err.value.message, err.value
    finally:
        await server.close()


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("0.0.0.0", KEY, False),
                                               ("127.0.0.1", None, False)])
async def test_a_keyless_listener_on_a_public_interface_warns(host: str, key: bytes | None, warned: bool,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    server = TcpTransport(KVTransferConfig(key=key))
    with caplog.at_level(logging.WARNING, logger="backends.kv_transfer.tcp_server"):
        await server.serve(make_kv(4), host, 0)
    await server.close()
    assert any("has no key" in r.getMessage() for r in caplog.records) is warned, caplog.records
