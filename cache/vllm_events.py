"""vLLM's KV cache events (`--kv-events-config`) decoded, and its block hashes mapped onto ours.

vLLM publishes msgpack batches `[timestamp, [event, ...], data_parallel_rank?]`; each event is a tagged
struct, a map with `type` (vLLM >= 0.11) or a list whose first item is the tag (earlier releases):
`BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, ...), `BlockRemoved`
(block_hashes, medium) and `AllBlocksCleared`. vLLM's hashes are its own (sha256 or a salted hash),
so `VllmBlockMap` recomputes `cache.block_hash` chained hashes from each stored block's token ids and
keeps vLLM hash -> our hashes, letting the gateway's request-side hashes match. Pure: no sockets here.
"""
from __future__ import annotations

import enum
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack

from cache.block_hash import ROOT_HASH, hash_block_tokens

# vLLM's ExternalBlockHash: bytes (sha256 digests) or int (older hash functions).
VllmHash = bytes | int


class VllmEventType(str, enum.Enum):
    STORED = "BlockStored"          # blocks now cached on the engine (new, or a prefix hit re-announced)
    REMOVED = "BlockRemoved"        # blocks evicted
    CLEARED = "AllBlocksCleared"    # the engine dropped its whole prefix cache


@dataclass(frozen=True, slots=True)
class VllmEvent:
    type: VllmEventType
    block_hashes: tuple[VllmHash, ...]     # vLLM's hashes, one per block (empty for CLEARED)
    parent_block_hash: VllmHash | None     # STORED: the block before the first one; None: prompt start
    token_ids: tuple[int, ...]             # STORED: the tokens of all its blocks, in order
    block_size: int                        # STORED: vLLM's tokens per block (0 otherwise)
    medium: str | None                     # "GPU" (or None): the engine's own cache; "CPU" etc.: an offload tier
    num_plain_blocks: int = 0              # STORED: leading blocks hashed from tokens alone (no LoRA, media,
                                           # cache salt in vLLM's extra keys): only those can match our hashes


# Positional field order of vLLM's array-like events, after the tag (vllm/distributed/kv_events.py).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


def decode_batch(payload: bytes) -> tuple[float, list[VllmEvent]]:
    """One ZMQ payload -> (timestamp, events); raises ValueError on anything malformed. Events of
    unknown types are skipped (a newer vLLM may add some)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"undecodable KV event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list) \
            or isinstance(batch[0], bool) or not isinstance(batch[0], (int, float)):
        raise ValueError("a KV event batch must be [timestamp, [events...], ...]")
    events = [e for e in (_decode_event(raw) for raw in batch[1]) if e is not None]
    return float(batch[0]), events


def _decode_event(raw: Any) -> VllmEvent | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        names = _STORED_FIELDS if tag == VllmEventType.STORED.value else _REMOVED_FIELDS
        fields = dict(zip(names, values, strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, fields = raw["type"], raw
    else:
        raise ValueError(f"malformed KV event: {raw!r:.200}")
    try:
        kind = VllmEventType(tag)
    except ValueError:
        return None
    if kind is VllmEventType.CLEARED:
        return VllmEvent(kind, (), None, (), 0, None)
    hashes = fields.get("block_hashes")
    medium = fields.get("medium")
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes) \
            or not (medium is None or isinstance(medium, str)):
        raise ValueError(f"malformed {tag}: {raw!r:.200}")
    if kind is VllmEventType.REMOVED:
        return VllmEvent(kind, tuple(hashes), None, (), 0, medium)
    parent, tokens, block_size = fields.get("parent_block_hash"), fields.get("token_ids"), fields.get("block_size")
    if not (parent is None or _is_hash(parent)) or not isinstance(tokens, list) \
            or not _is_int(block_size) or block_size <= 0:
        raise ValueError(f"malformed {tag}: {raw!r:.200}")
    try:  # uint32 ids, as cache.block_hash packs them; checked in C, 20x faster than per item in Python
        token_ids = tuple(array("I", tokens))
    except (TypeError, OverflowError):
        raise ValueError(f"malformed {tag}: token ids must be integers in [0, 2**32)") from None
    return VllmEvent(kind, tuple(hashes), parent, token_ids, block_size, medium, _num_plain_blocks(fields, len(hashes)))


def _num_plain_blocks(fields: dict[str, Any], num_blocks: int) -> int:
    """Leading blocks whose vLLM hash covers their tokens only. A LoRA adapter, a multimodal input or a
    cache salt changes vLLM's hash (and what the cache can be reused for); our request-side hashes know
    none of them, so such blocks must not be mapped onto ours."""
    if fields.get("lora_id") is not None or fields.get("lora_name") is not None:
        return 0
    extra = fields.get("extra_keys")
    if not isinstance(extra, list):
        return num_blocks
    for i, keys in enumerate(extra[:num_blocks]):
        if keys:
            return i
    return num_blocks


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: object) -> TypeGuard[VllmHash]:
    return isinstance(value, bytes) or _is_int(value)


def is_engine_cache(event: VllmEvent) -> bool:
    """The event is about the engine's own KV cache (a prompt sent there reuses it), not an offload tier."""
    return event.medium is None or event.medium.upper() == "GPU"


class VllmBlockMap:
    """One engine's vLLM block hash -> our chained hashes of the same tokens (several of ours when
    vLLM's block is a multiple of ours). Bounded: the oldest entries go first past `max_entries`
    (their blocks then simply cannot be removed or extended: harmless for an LRU index)."""

    def __init__(self, block_size: int, max_entries: int = 1 << 20) -> None:
        if block_size <= 0 or max_entries <= 0:
            raise ValueError("block_size and max_entries must be positive")
        self.block_size = block_size                # our tokens per block (the model's, from config)
        self._max_entries = max_entries
        self._ours: OrderedDict[VllmHash, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ours)

    def stored(self, event: VllmEvent) -> list[int]:
        """Our hashes of a `BlockStored`'s blocks, recorded for later events. Stops at a block it cannot
        map: a parent it never saw (stored before we subscribed), a vLLM block size that is not a
        multiple of ours, a partial block (its tokens end mid-block of ours), or one hashed with extra
        keys (LoRA, media, cache salt)."""
        if event.parent_block_hash is None:
            parent = ROOT_HASH
        else:
            known = self._ours.get(event.parent_block_hash)
            if not known:
                return []
            parent = known[-1]
        size = self.block_size
        if event.block_size % size:
            return []
        ours: list[int] = []
        tokens = event.token_ids
        for i, vllm_hash in enumerate(event.block_hashes[:event.num_plain_blocks]):
            chunk = tokens[i * event.block_size:(i + 1) * event.block_size]
            if len(chunk) != event.block_size:
                break
            block: list[int] = []
            for start in range(0, len(chunk), size):
                parent = hash_block_tokens(parent, chunk[start:start + size])
                block.append(parent)
            self._remember(vllm_hash, tuple(block))
            ours.extend(block)
        return ours

    def removed(self, block_hashes: Sequence[VllmHash]) -> list[int]:
        """Our hashes of evicted vLLM blocks (unknown ones are skipped), forgotten here."""
        ours: list[int] = []
        for vllm_hash in block_hashes:
            ours.extend(self._ours.pop(vllm_hash, ()))
        return ours

    def clear(self) -> None:
        self._ours.clear()

    def _remember(self, vllm_hash: VllmHash, ours: tuple[int, ...]) -> None:
        self._ours[vllm_hash] = ours
        self._ours.move_to_end(vllm_hash)
        if len(self._ours) > self._max_entries:
            self._ours.popitem(last=False)
