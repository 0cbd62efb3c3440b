"""TorchPagedKV as source and sink, without sockets: pieces, staging, writes."""
from __future__ import annotations

import pytest
import torch

from backends.kv_transfer.torch_cache import TorchPagedKV

from .conftest import make_kv, snapshot

IDS = [7, 8, 9, 30, 2, 3, 50]  # runs: [7..9], [30], [2, 3], [50]


def expected_payload(kv: TorchPagedKV, layer: int, ids: list[int]) -> bytes:
    k, v = kv.layers[layer]
    return k[ids].view(torch.uint8).numpy().tobytes() + v[ids].view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_pieces, num_pieces", [(2, 2), (7, 2), (8, 8), (1024, 8)])
def test_reader_pieces_concatenate_to_the_payload(dtype: torch.dtype, max_pieces: int, num_pieces: int) -> None:
    kv = make_kv(64, dtype, seed=1)
    before = snapshot(kv)
    reader = kv.reader(IDS, max_pieces)
    for layer in range(len(kv.layers)):
        pieces = reader.read_layer(layer)
        assert len(pieces) == num_pieces  # one per run of K and of V, or K and V gathered
        assert b"".join(bytes(p) for p in pieces) == expected_payload(kv, layer, IDS)
    reader.close()
    # exact (reading writes nothing); bytes: random bits include NaNs
    for (k, v), (k0, v0) in zip(kv.layers, before, strict=True):
        assert torch.equal(k.view(torch.uint8), k0.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), v0.view(torch.uint8))


@pytest.mark.parametrize("ids", [IDS, list(range(20, 27))])
def test_writer_places_k_and_v_blocks_in_order(ids: list[int]) -> None:
    src, dst = make_kv(64, torch.bfloat16, seed=1), make_kv(64, torch.bfloat16, seed=2)
    src_ids = [40, 1, 2, 3, 60, 61, 5]
    writer = dst.writer(ids)
    for layer in range(len(dst.layers)):
        payload = memoryview(expected_payload(src, layer, src_ids))
        for piece in writer.layer_buffer(layer):
            piece[:], payload = payload[:len(piece)], payload[len(piece):]
        assert not payload
        writer.commit_layer(layer)
    writer.close()
    for layer in range(len(dst.layers)):
        assert expected_payload(dst, layer, ids) == expected_payload(src, layer, src_ids)


def test_staging_buffers_are_reused() -> None:
    kv = make_kv(64)
    for _ in range(3):
        writer = kv.writer(IDS)
        writer.layer_buffer(0)
        writer.close()
    assert len(kv._free_staging) == 1


@pytest.mark.parametrize("ids, needle", [([1, 64], "outside"), ([-1], "outside"), ([3, 3], "repeat")])
def test_bad_block_ids(ids: list[int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_kv(64).writer(ids)


def test_mixed_layers_are_rejected() -> None:
    k = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match="share one shape"):
        TorchPagedKV([(k, k), (k, k.half())])
    with pytest.raises(ValueError, match="contiguous"):
        TorchPagedKV([(k.transpose(0, 1), k.transpose(0, 1))])


def test_writer_lands_long_runs_in_place() -> None:
    kv = make_kv(4096)  # block_nbytes 256: runs of 1024 blocks are 256 KiB
    ids = [*range(2000, 3024), *range(0, 1024)]
    writer = kv.writer(ids)
    pieces = writer.layer_buffer(0)
    assert len(pieces) == 4 and all(len(p) == 1024 * 256 for p in pieces)
    writer.close()
    assert not kv._free_staging  # no staging was needed
    assert len(kv.writer(ids[::-1]).layer_buffer(0)) == 2  # single blocks: staged
