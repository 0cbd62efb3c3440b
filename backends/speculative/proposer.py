"""The proposer interface: what the engine asks of a drafting method, and nothing more.

Each step, before scheduling, the engine asks the proposer for up to `num_tokens` draft tokens per
decoding sequence (`propose`). The target model then checks them all in one forward over the
sequence's last token and its drafts (`verify` in `backends/worker/sampler.py`). A proposer keeps whatever
state it needs per request id (an n-gram index, a draft model's own paged KV) and drops it in `free`.

Drafts are deterministic (a proposer's best guess, not a sample), so verification treats the draft
distribution as one-hot: the accepted tokens are distributed exactly as the target's own samples.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class DraftRequest:
    request_id: str
    token_ids: Sequence[int]   # prompt + verified output; the last token is not yet in the target's KV
    num_tokens: int            # drafts wanted, >= 1; fewer (or none) may come back


class Proposer(Protocol):
    name: str                  # "ngram", "draft", "eagle", "ngram+eagle" ...: the label of its metrics
    # A drafted token's cost as a fraction of one target decode step, for the adaptive K.
    cost_per_token: float
    # True: the engine calls `observe` with the target's final hidden states (EAGLE heads).
    wants_hidden: bool

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """One list of draft tokens per request, in order, each at most `num_tokens` long."""
        ...

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """The target's final (normed) hidden states [n, hidden] at positions start..start+n-1, all of
        which are verified now; `token_ids` is the sequence's tokens at that moment (so
        token_ids[start + i + 1], where it exists, is the token that followed position start + i).
        Called after every step that ran the sequence, only when `wants_hidden`."""
        ...

    def free(self, request_id: str) -> None:
        """The sequence finished or was preempted: drop its state (idempotent)."""
        ...
