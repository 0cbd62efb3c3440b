"""The single definition of a KV block's identity: a chained hash of its token ids.

Workers key their prefix cache with it and the gateway scores endpoints with it, so both must
import this module rather than re-implement it. Pure: no I/O, no torch.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Hash of the (empty) parent of a sequence's first block.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash one block from its parent's hash and its own token ids (64-bit, stable across processes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little", signed=False))
    h.update(array("I", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every *full* block of `token_ids`; a trailing partial block has none."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
