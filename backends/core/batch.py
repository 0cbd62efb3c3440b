"""The contract between the scheduler and the model runner: what to run in one forward step.

The scheduler decides *which* tokens run; the runner only turns a `ForwardBatch` into logits.
KV for every token of a chunk is written in place into the paged cache at the slots its block
table names (slot = block_table[pos // block_size] * block_size + pos % block_size).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeqChunk:
    token_ids: tuple[int, ...]     # the new tokens to run (a prefill chunk, or one decode token)
    num_context_tokens: int        # tokens before these whose KV is already in the cache
    block_table: tuple[int, ...]   # physical block ids covering context + new tokens, in order
    want_logits: bool = True       # False for a prefill chunk that does not end the prompt
    num_logits: int = 1            # with want_logits: logits for this many last tokens (1 + drafts to verify)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    chunks: tuple[SeqChunk, ...]   # one per scheduled sequence; prefills and decodes mixed

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
