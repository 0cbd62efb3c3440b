"""A prompt's leading run at one endpoint, read through its KV tiers as the worker's connector reads them
(backends/kv_connectors/tiers/connector.py): its device run, then the blocks host RAM or the local disk holds,
then those the store holds, each block read from the fastest tier holding it. Pure: the prefix index
(cache/prefix_index.py) hands in its maps.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from cache.kv_events import CPU, DISK, MEDIA, MEDIUM_BITS, STORE

if TYPE_CHECKING:
    from cache.prefix_index import PrefixIndex

_LOCAL_BITS, _STORE_BIT = MEDIUM_BITS[CPU] | MEDIUM_BITS[DISK], MEDIUM_BITS[STORE]
_INDEX_OF_BIT = {MEDIUM_BITS[medium]: i for i, medium in enumerate(MEDIA)}

# A prompt's leading run at one endpoint by the medium each block is read from, in MEDIA order: its
# device run, then past it the blocks host RAM or the local disk holds, then those the store holds, as
# backends/kv_connectors/tiers/connector.py looks them up; each block read from the fastest tier holding it.
MatchedByMedium = tuple[int, int, int, int]
NO_MATCH: MatchedByMedium = (0, 0, 0, 0)
RestoreFractions = tuple[float | None, float | None, float | None]   # (cpu, disk, store) as workers measure them


def tier_run(tiers: Mapping[int, int], block_hashes: Sequence[int], num_device: int,
              shared_runs: Sequence[int] | None = None) -> MatchedByMedium:
    """`MatchedByMedium` of the leading run whose first `num_device` blocks are on the device, followed
    on through `tiers` (hash -> MEDIUM_BITS); `shared_runs`: the endpoint reads a shared store instead of
    keeping store blocks of its own, whose run from each block of the prompt it gives (`runs_from`)."""
    counts = [num_device, 0, 0, 0]
    n, end, get, index_of_bit = num_device, len(block_hashes), tiers.get, _INDEX_OF_BIT  # locals: per block
    while n < end and (media := get(block_hashes[n], 0)) & _LOCAL_BITS:  # the local tiers' run
        counts[index_of_bit[media & -media]] += 1  # read from the fastest tier holding it
        n += 1
    # then the store's, each block still read from a local tier that has it
    if shared_runs is None:
        while n < end and (media := get(block_hashes[n], 0)) & _STORE_BIT:
            counts[index_of_bit[media & -media]] += 1
            n += 1
    elif not tiers:
        counts[3] = shared_runs[n]
    else:
        for block_hash in block_hashes[n:n + shared_runs[n]]:
            media = get(block_hash, 0) | _STORE_BIT
            counts[index_of_bit[media & -media]] += 1
    return counts[0], counts[1], counts[2], counts[3]


def held_levels(block_hashes: Sequence[int], device: Mapping[int, int], own_tiers: Mapping[int, int],
                stores: Sequence[tuple[Mapping[int, None], int]], mask: int) -> list[tuple[int, int]]:
    """`PrefixIndex.matched_levels` of the endpoints in `mask`, a block counted where its device (`device`: hash ->
    holders), its own tiers (`own_tiers`) or a store it reads ((blocks, readers) of each) holds it. The walk of
    `matched_levels` with tiers; kept apart from that one, which runs on every prefix-aware request."""
    levels: list[tuple[int, int]] = []
    alive, depth = mask, 0
    for block_hash in block_hashes:
        holders = device.get(block_hash, 0) | own_tiers.get(block_hash, 0)
        for blocks, readers in stores:
            if block_hash in blocks:
                holders |= readers
        holders &= alive
        if holders != alive and depth:
            levels.append((depth, alive))
        alive = holders
        if not alive:
            return levels
        depth += 1
    if depth:
        levels.append((depth, alive))
    return levels


def runs_from(blocks: Mapping[int, None], block_hashes: Sequence[int]) -> list[int]:
    """[len + 1]: how many blocks of `block_hashes` from each position on `blocks` holds in a row (0 at the end):
    one pass over the prompt for every endpoint that reads the store."""
    runs = [0] * (len(block_hashes) + 1)
    for i in range(len(block_hashes) - 1, -1, -1):
        if block_hashes[i] in blocks:
            runs[i] = runs[i + 1] + 1
    return runs


class SharedStore:
    """The blocks one shared store holds, as its workers announced them: every worker that reads it can load
    them back, whichever wrote them."""
    __slots__ = ("blocks", "key", "members")

    def __init__(self, key: str) -> None:
        self.key = key
        self.blocks: OrderedDict[int, None] = OrderedDict()   # hash -> None, oldest first
        self.members = 0                                        # bits of the endpoints that read it


class PromptTiers:
    """What one prompt's KV tier blocks are worth where they are (policies.fleet_view.TierMatches), for a policy
    that scores them over a live view; read for one decision (the index must not change meanwhile). The stores'
    runs are walked on first read; `restore_fractions`: each endpoint's measured ones (the load tracker)."""
    __slots__ = ("_block_hashes", "_index", "_own_levels", "_stores", "own_mask", "restore_fractions")

    def __init__(self, index: PrefixIndex, block_hashes: Sequence[int],
                 restore_fractions: Callable[[str], RestoreFractions]) -> None:
        self._index = index
        self._block_hashes = block_hashes
        self._stores: list[tuple[int, list[int]]] | None = None
        self._own_levels: list[tuple[int, int]] | None = None
        self.own_mask = index.own_tier_mask
        self.restore_fractions = restore_fractions

    @property
    def stores(self) -> list[tuple[int, list[int]]]:
        if self._stores is None:
            self._stores = self._index.store_runs(self._block_hashes)
        return self._stores

    @property
    def own_levels(self) -> list[tuple[int, int]]:
        if self._own_levels is None:
            self._own_levels = self._index.own_tier_levels(self._block_hashes)
        return self._own_levels

    def matched(self, endpoint_id: str, num_device: int) -> MatchedByMedium:
        return self._index.matched_by_medium(endpoint_id, self._block_hashes, num_device)
