"""A prompt's leading runs in the prefix index (cache/prefix_index.py, `PrefixIndex.matched_levels`), walked only when
first read."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import overload

Levels = list[tuple[int, int]]   # by increasing depth, (depth, bitmask of the endpoints whose run is that long)


class LazyLevels(Sequence[tuple[int, int]]):
    """A prompt's `PrefixIndex.matched_levels`, walked on first read: a policy that decides without them (session
    affinity, least tokens) costs no walk of the prompt's blocks, and its pick's run is then looked up alone
    (`num_matched_blocks`). Read it before the index changes (one routing decision)."""
    __slots__ = ("_block_hashes", "_levels", "_walker")

    def __init__(self, walker: Callable[[Sequence[int]], Levels], block_hashes: Sequence[int]) -> None:
        """`walker`: the index's `matched_levels`."""
        self._walker = walker
        self._block_hashes = block_hashes
        self._levels: Levels | None = None   # None: not walked yet

    @property
    def walked(self) -> bool:
        return self._levels is not None

    def _walk(self) -> Levels:
        if self._levels is None:
            self._levels = self._walker(self._block_hashes)
        return self._levels

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._walk())

    def __len__(self) -> int:
        return len(self._walk())

    @overload
    def __getitem__(self, i: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[int, int]]: ...

    def __getitem__(self, i: int | slice) -> tuple[int, int] | Sequence[tuple[int, int]]:
        return self._walk()[i]
