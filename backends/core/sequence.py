"""One sequence: its tokens, progress through the KV cache, and lifecycle state.

Mutable and owned by the engine thread; only frozen outputs leave it. Holds no blocks itself:
`block_table` is bookkeeping that the block manager fills and empties.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import FinishReason
from backends.core.sampling_params import SamplingParams
from backends.core.spec_state import SpecState
from cache.block_hash import ROOT_HASH, hash_block_tokens


class SequenceStatus(enum.Enum):
    WAITING = "waiting"                  # queued, holds no blocks
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"   # holds blocks a KV connector is loading into
    RUNNING = "running"                  # holds blocks; prefilling or decoding
    FINISHED = "finished"                # done; blocks freed or held under a handle


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams | None               # None: an embedding input (prefill only; pooled, never sampled)
    seed: int                                   # resolved sampling seed (random when params.seed is None)
    arrival_s: float = 0.0                      # monotonic arrival time
    kv_transfer: KVTransferParams | None = None # its part in a KV transfer (disaggregated legs); None: none
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0                # tokens whose KV is in the cache
    num_cached_tokens: int = 0                  # prompt tokens served by the prefix cache at first admission
    num_registered_blocks: int = 0              # leading full blocks already offered to the prefix cache
    num_external_tokens: int = 0                # tokens past num_computed_tokens a KV connector is loading
    num_preemptions: int = 0
    admission: int = 0                          # its place in the scheduler's admission order (`running` keeps it)
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the coming step
    spec: SpecState = field(default_factory=SpecState)        # its drafts' acceptance (adaptive K)
    json_state: Any = None                      # structured output: (its grammar's masks, the recognizer's state)
    _block_hashes: list[int] = field(default_factory=list)
    _all_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._all_tokens = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens; do not mutate."""
        return self._all_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token is missing from the cache (prompt, or recompute)."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_embedding(self) -> bool:
        """An embedding input: it ends with its last prompt chunk, pooled; it never decodes."""
        return self.params is None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_tokens.append(token_id)

    def block_hash(self, index: int, block_size: int) -> int:
        """Chained hash of full block `index`, computed once (tokens are append-only)."""
        while len(self._block_hashes) <= index:
            i = len(self._block_hashes)
            end = (i + 1) * block_size
            if end > len(self._all_tokens):
                raise ValueError(f"block {i} of {self.request_id} is not full")
            parent = self._block_hashes[-1] if self._block_hashes else ROOT_HASH
            self._block_hashes.append(hash_block_tokens(parent, self._all_tokens[i * block_size:end]))
        return self._block_hashes[index]

    def parent_hash(self, index: int, block_size: int) -> int:
        return ROOT_HASH if index == 0 else self.block_hash(index - 1, block_size)
