"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's last
n tokens (n from `max_n` down to `min_n`), in its prompt or its output so far.

Per request, an index from each n-gram to the position after its latest occurrence grows with the
sequence (a few dict updates per new token); a lookup is one dict probe per n. Costs nothing on the
model side, so `cost_per_token` is 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.speculative.proposer import DraftRequest


class _Index:
    __slots__ = ("by_n", "num_indexed")

    def __init__(self, ns: range) -> None:
        self.by_n: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ns}
        self.num_indexed = 0            # n-grams ending before this token position are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token (so each has a follower)."""
        end = len(tokens) - 1
        for e in range(self.num_indexed, end):       # n-gram ending at e, followed by tokens[e + 1]
            for n, table in self.by_n.items():
                if e + 1 >= n:
                    table[tuple(tokens[e + 1 - n:e + 1])] = e + 1
        self.num_indexed = max(self.num_indexed, end)


class NgramProposer:
    name = "ngram"
    cost_per_token = 0.0
    wants_hidden = False

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self._ns = range(max_n, min_n - 1, -1)
        self._indexes: dict[str, _Index] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> list[int]:
        tokens = request.token_ids
        index = self._indexes.get(request.request_id)
        if index is None or index.num_indexed > len(tokens):
            index = self._indexes[request.request_id] = _Index(self._ns)
        index.extend(tokens)
        for n in self._ns:
            if len(tokens) <= n:
                continue
            follow = index.by_n[n].get(tuple(tokens[len(tokens) - n:]))
            if follow is not None:
                return list(tokens[follow:follow + request.num_tokens])
        return []

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        return None

    def free(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
