"""vLLM's KV cache events (`--kv-events-config`) decoded, and its block hashes mapped onto ours.

vLLM publishes msgpack batches `[timestamp, [event, ...], data_parallel_rank?]`; each event is a tagged
struct, a map with `type` (vLLM >= 0.11) or a list whose first item is the tag (earlier releases):
`BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, ..., medium), `BlockRemoved`
(block_hashes, medium) and `AllBlocksCleared`; `medium_of` names an event's medium as our index does.
vLLM's hashes are its own (sha256 or a salted hash), so `VllmBlockMap` recomputes `cache.block_hash`
chained hashes from each stored block's token ids and keeps vLLM hash -> our hashes, letting the
gateway's request-side hashes match. Pure: no sockets here.
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
from cache.kv_events import DEVICE, DISK, MEDIUM_BITS, STORE

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
    medium: str | None                     # "GPU" (or None): the engine's own cache; "CPU", "STORAGE": an offload tier
    num_plain_blocks: int = 0              # STORED: leading blocks hashed from tokens alone (no LoRA, media,
                                           # cache salt in vLLM's extra keys): only those can match our hashes
    locality: str | None = None            # a tier's "LOCAL" or "REMOTE" (vLLM >= 0.32); None: not said


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
    medium, locality = fields.get("medium"), fields.get("locality")
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes) \
            or not (medium is None or isinstance(medium, str)) or not (locality is None or isinstance(locality, str)):
        raise ValueError(f"malformed {tag}: {raw!r:.200}")
    if kind is VllmEventType.REMOVED:
        return VllmEvent(kind, tuple(hashes), None, (), 0, medium, 0, locality)
    parent, tokens, block_size = fields.get("parent_block_hash"), fields.get("token_ids"), fields.get("block_size")
    if block_size == 0 and tokens == []:  # an offload tier's placeholder (vLLM had no metadata): nothing to map
        return VllmEvent(kind, tuple(hashes), None, (), 0, medium, 0, locality)
    if not (parent is None or _is_hash(parent)) or not isinstance(tokens, list) \
            or not _is_int(block_size) or block_size <= 0:
        raise ValueError(f"malformed {tag}: {raw!r:.200}")
    try:  # uint32 ids, as cache.block_hash packs them; checked in C, 20x faster than per item in Python
        token_ids = tuple(array("I", tokens))
    except (TypeError, OverflowError):
        raise ValueError(f"malformed {tag}: token ids must be integers in [0, 2**32)") from None
    return VllmEvent(kind, tuple(hashes), parent, token_ids, block_size, medium, _num_plain_blocks(fields, len(hashes)),
                     locality)


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


def medium_of(event: VllmEvent) -> str | None:
    """The event's medium as our index names it (cache.kv_events.MEDIA); None: a medium we do not know
    (its events are skipped). vLLM names the engine's own cache "GPU" (or leaves it out), its CPU offload
    tier "CPU", its storage tiers "STORAGE", local (a disk of its own) or remote (shared: our store; also
    when it does not say, the lower weight); a connector may use our lowercase names (Mooncake's "cpu")."""
    name = (event.medium or "GPU").upper()
    if name == "GPU":
        return DEVICE
    if name == "STORAGE":
        return DISK if (event.locality or "").upper() == "LOCAL" else STORE
    return name.lower() if name.lower() in MEDIUM_BITS else None


class VllmBlockMap:
    """One engine's vLLM block hash -> our chained hashes of the same tokens (several of ours when
    vLLM's block is a multiple of ours), kept while some medium (the GPU cache, an offload tier) holds
    the block. Bounded: the oldest entries go first past `max_entries` (their blocks then simply cannot
    be removed or extended: harmless for an LRU index)."""

    def __init__(self, block_size: int, max_entries: int = 1 << 20) -> None:
        if block_size <= 0 or max_entries <= 0:
            raise ValueError("block_size and max_entries must be positive")
        self.block_size = block_size                # our tokens per block (the model's, from config)
        self._max_entries = max_entries
        # vLLM hash -> (our hashes, MEDIUM_BITS of the media holding it), oldest first
        self._ours: OrderedDict[VllmHash, tuple[tuple[int, ...], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ours)

    def stored(self, event: VllmEvent, medium: str = DEVICE) -> list[int]:
        """Our hashes of a `BlockStored`'s blocks, recorded (as held in `medium`) for later events. Stops at
        a block it cannot map: a parent it never saw (stored before we subscribed), a vLLM block size that
        is not a multiple of ours, a partial block (its tokens end mid-block of ours), or one hashed with
        extra keys (LoRA, media, cache salt)."""
        if event.parent_block_hash is None:
            parent = ROOT_HASH
        else:
            known = self._ours.get(event.parent_block_hash)
            if known is None:
                return []
            parent = known[0][-1]
        medium_bit = MEDIUM_BITS[medium]
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
            self._remember(vllm_hash, tuple(block), medium_bit)
            ours.extend(block)
        return ours

    def removed(self, block_hashes: Sequence[VllmHash], medium: str = DEVICE) -> list[int]:
        """Our hashes of vLLM blocks `medium` dropped (unknown ones are skipped), forgotten here once no
        medium holds them."""
        ours: list[int] = []
        medium_bit = MEDIUM_BITS[medium]
        for vllm_hash in block_hashes:
            entry = self._ours.get(vllm_hash)
            if entry is None:
                continue
            ours.extend(entry[0])
            if entry[1] & ~medium_bit:
                self._ours[vllm_hash] = (entry[0], entry[1] & ~medium_bit)
            else:
                del self._ours[vllm_hash]
        return ours

    def clear(self) -> None:
        self._ours.clear()

    def _remember(self, vllm_hash: VllmHash, ours: tuple[int, ...], medium_bit: int) -> None:
        known = self._ours.pop(vllm_hash, None)
        self._ours[vllm_hash] = (ours, medium_bit | (known[1] if known else 0))  # most recent last
        if len(self._ours) > self._max_entries:
            self._ours.popitem(last=False)
