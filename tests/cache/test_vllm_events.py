"""vLLM KV event batches as vLLM's msgspec encoder writes them (tagged structs: a map with `type` in
vLLM >= 0.11, a list led by the tag before), decoded and mapped onto our chained block hashes."""
from __future__ import annotations

import hashlib

import msgpack
import pytest

from cache.block_hash import block_hashes
from cache.kv_events import CPU, DEVICE, DISK, STORE
from cache.vllm_events import VllmBlockMap, VllmEvent, VllmEventType, decode_batch, medium_of


def vllm_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """A stand-in for vLLM's sha256 block hash: opaque bytes, chained, never equal to ours."""
    return hashlib.sha256((parent or b"root") + repr(tokens).encode()).digest()


def stored_event(tokens: list[int], block_size: int, parent: bytes | None = None, *, as_list: bool = False,
                 medium: str | None = "GPU") -> tuple[dict | list, list[bytes]]:
    hashes, prev = [], parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = vllm_hash(prev, tokens[start:start + block_size])
        hashes.append(prev)
    if as_list:  # vLLM < 0.11: array_like, tag first, fields in declaration order
        return ["BlockStored", hashes, parent, tokens, block_size, None, medium], hashes
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None,
            "extra_keys": [None] * len(hashes), "group_idx": 0}, hashes


def batch(*events: object, rank: int | None = 0) -> bytes:
    body: list[object] = [1732412345.25, list(events)]
    if rank is not None:
        body.append(rank)
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("as_list", [False, True])
def test_stored_blocks_map_to_our_hashes(as_list: bool) -> None:
    tokens = list(range(100, 148))  # 3 blocks of 16
    event, hashes = stored_event(tokens, 16, as_list=as_list)
    ts, events = decode_batch(batch(event))
    assert ts == 1732412345.25 and len(events) == 1
    (e,) = events
    assert (e.type, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium) == (
        VllmEventType.STORED, tuple(hashes), None, tuple(tokens), 16, "GPU")
    block_map = VllmBlockMap(block_size=16)
    assert block_map.stored(e) == block_hashes(tokens, 16)  # exactly the gateway's request-side hashes


def test_a_child_event_chains_on_its_mapped_parent() -> None:
    prompt = list(range(64))
    first, first_hashes = stored_event(prompt[:32], 16)
    second, _ = stored_event(prompt[32:], 16, parent=first_hashes[-1])
    block_map = VllmBlockMap(block_size=16)
    _, events = decode_batch(batch(first, second))
    ours = [h for e in events for h in block_map.stored(e)]
    assert ours == block_hashes(prompt, 16)
    orphan, _ = stored_event(list(range(16)), 16, parent=b"never seen")
    assert block_map.stored(decode_batch(batch(orphan))[1][0]) == []  # stored before we subscribed


def test_a_vllm_block_spanning_several_of_ours() -> None:
    tokens = list(range(7, 7 + 64))
    event, hashes = stored_event(tokens, 32)
    block_map = VllmBlockMap(block_size=16)
    assert block_map.stored(decode_batch(batch(event))[1][0]) == block_hashes(tokens, 16)
    assert block_map.removed([hashes[1]]) == block_hashes(tokens, 16)[2:]  # the second vLLM block = our 3rd, 4th
    assert VllmBlockMap(block_size=48).stored(decode_batch(batch(event))[1][0]) == []  # 32 is no multiple of 48


def test_removed_and_cleared() -> None:
    event, hashes = stored_event(list(range(32)), 16)
    block_map = VllmBlockMap(block_size=16)
    ours = block_map.stored(decode_batch(batch(event))[1][0])
    removed = {"type": "BlockRemoved", "block_hashes": [hashes[1], b"unknown"], "medium": "GPU"}
    _, (r, c) = decode_batch(batch(removed, {"type": "AllBlocksCleared"}))
    assert r == VllmEvent(VllmEventType.REMOVED, (hashes[1], b"unknown"), None, (), 0, "GPU")
    assert block_map.removed(r.block_hashes) == [ours[1]]
    assert block_map.removed(r.block_hashes) == []  # forgotten once removed
    assert c.type is VllmEventType.CLEARED
    _, (legacy,) = decode_batch(batch(["BlockRemoved", [hashes[0]], None], rank=None))
    assert legacy.block_hashes == (hashes[0],) and legacy.medium is None


def test_int_hashes_unknown_types_and_media() -> None:
    event = {"type": "BlockStored", "block_hashes": [12345], "parent_block_hash": None,
             "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "CPU"}
    _, events = decode_batch(batch(event, {"type": "SomethingNew", "x": 1}))
    assert len(events) == 1 and events[0].block_hashes == (12345,)
    assert medium_of(events[0]) == CPU  # vLLM's CPU offload tier


@pytest.mark.parametrize(("medium", "locality", "expected"), [
    (None, None, DEVICE), ("GPU", None, DEVICE), ("gpu", None, DEVICE),
    ("CPU", None, CPU), ("cpu", "LOCAL", CPU),                             # Mooncake's store connector says "cpu"
    ("STORAGE", "LOCAL", DISK), ("STORAGE", "REMOTE", STORE), ("STORAGE", None, STORE),
    ("disk", None, DISK), ("store", None, STORE),
    ("NVME_OF", None, None), ("LMCACHE", "LOCAL", None),                   # media we cannot rank: skipped
])
def test_medium_of(medium: str | None, locality: str | None, expected: str | None) -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": medium, "locality": locality}
    (event,) = decode_batch(batch(removed))[1]
    assert (event.locality, medium_of(event)) == (locality, expected)


def test_a_block_stays_mapped_while_a_tier_holds_it() -> None:
    """vLLM evicts a block from the GPU and later from its CPU tier (same vLLM hash): the second removal
    must still map onto our hashes, and an offload tier's placeholder store (no metadata) maps nothing
    without failing the batch it came in."""
    event, hashes = stored_event(list(range(32)), 16)
    block_map = VllmBlockMap(block_size=16)
    (gpu,) = decode_batch(batch(event))[1]
    ours = block_map.stored(gpu)
    assert block_map.stored(gpu, CPU) == ours  # offloaded: the same blocks, now in host RAM too
    assert block_map.removed(hashes, DEVICE) == ours
    assert block_map.removed(hashes, CPU) == ours
    assert block_map.removed(hashes, CPU) == [] and len(block_map) == 0  # no medium holds them: forgotten
    placeholder = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [],
                   "block_size": 0, "lora_id": None, "medium": "CPU"}
    _, (p, g) = decode_batch(batch(placeholder, event))
    assert block_map.stored(p, CPU) == [] and block_map.stored(g) == ours


def test_block_map_is_bounded() -> None:
    block_map = VllmBlockMap(block_size=4, max_entries=3)
    event, hashes = stored_event(list(range(20)), 4)
    block_map.stored(decode_batch(batch(event))[1][0])
    assert len(block_map) == 3
    assert block_map.removed(hashes[:2]) == []  # the oldest two were dropped


@pytest.mark.parametrize("payload", [
    b"\xc1",                                                       # not msgpack
    msgpack.packb({"ts": 1}),                                      # not an array
    msgpack.packb([1.0, "events"]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [1, -2], "block_size": 16}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [1, 2.5], "block_size": 16}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [2**32], "block_size": 16}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 1.5,
                          "token_ids": [1], "block_size": 16}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [True]}]]),
    msgpack.packb([1.0, [42]]),
])
def test_malformed_batches_raise_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


@pytest.mark.parametrize(("changes", "num_mapped"), [
    ({}, 3),
    ({"extra_keys": [None, None, None]}, 3),                      # as vLLM sends a plain prompt's
    ({"lora_id": 7, "lora_name": "adapter"}, 0),                  # a LoRA's blocks are not the base model's
    ({"extra_keys": [None, [["img-1", 0]], None]}, 1),            # an image from the 2nd block on
    ({"extra_keys": [["salt"], ["salt"], ["salt"]]}, 0),          # a cache salt on every block
])
def test_blocks_hashed_with_extra_keys_are_not_mapped(changes: dict, num_mapped: int) -> None:
    tokens = list(range(48))
    event, _ = stored_event(tokens, 16)
    event.update(changes)
    ours = VllmBlockMap(block_size=16).stored(decode_batch(batch(event))[1][0])
    assert ours == block_hashes(tokens, 16)[:num_mapped]
