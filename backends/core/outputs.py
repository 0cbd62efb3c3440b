"""What the engine hands back to the server: one record per live sequence after each step, its load and its
cumulative stats."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id, (set by the server) a stop string; an embedding pooled
    LENGTH = "length"    # max_tokens or the context limit
    ABORT = "abort"      # cancelled (client gone) or failed


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int                          # the sampled token
    logprob: float                         # its log-probability under the unmodified distribution
    top: tuple[tuple[int, float], ...]     # (token_id, logprob) of the top-k alternatives, best first


@dataclass(frozen=True, slots=True)
class SequenceOutput:
    request_id: str
    new_token_ids: tuple[int, ...]            # tokens produced by this step (usually one)
    logprobs: tuple[TokenLogprob, ...] | None # parallel to new_token_ids when asked for
    finish_reason: FinishReason | None        # set on the last output of a sequence
    num_prompt_tokens: int                    # prompt length as the engine counted it
    num_cached_tokens: int                    # prompt tokens served from the prefix cache
    error: str | None = None                  # set with ABORT when the engine failed the sequence
    # An embedding input's one output (finish_reason STOP): its vector, float32 little-endian, L2-normalised.
    embedding: bytes | None = None


@dataclass(frozen=True, slots=True)
class KVTierLoad:
    """One KV tier below the device pool (backends/kv_connectors/tiers), as /load and /metrics report it."""
    medium: str                  # backends/core/block_events: cpu, disk or store
    num_blocks: int              # blocks it holds (a store: -1, shared and not counted here)
    used_bytes: int
    capacity_bytes: int          # 0: not known (a store)
    num_restored_blocks: int     # blocks loaded back from it into the device pool, over the worker's life
    num_written_blocks: int      # blocks written into it
    up: bool = True              # a store: reachable now
    num_outages: int = 0         # a store: times it went down (the worker ran on without it meanwhile)
    restore_seconds: float = 0.0  # time spent reading blocks back from it, over the worker's life
    # Reading a token back from it, as a fraction of computing it (the engine's measured prefill cost per
    # token): what a gateway's routing weighs a block held here by. None until both are measured.
    restore_fraction: float | None = None
    # Blocks handed to it that it did not keep: a store whose pool is full of blocks read within its lease, or
    # that is down; a disk that cannot write. Each is a prefix a later request recomputes.
    num_failed_writes: int = 0
    # A store: the name of what it shares (the store's address and the KV namespace, hashed). Workers that report
    # the same one read each other's blocks there, and a gateway credits each of them with all of them. "": none.
    shared: str = ""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The engine's load as the gateway polls it (GET /load, verbatim) and /metrics reads it."""
    num_running: int                  # sequences admitted (prefilling or decoding)
    num_waiting: int                  # sequences queued for admission (or for remote KV)
    num_prefill_tokens_pending: int   # prompt/recompute tokens not yet in the KV cache
    num_decode_tokens_pending: int    # sum over live sequences of max_tokens still to come
    num_free_blocks: int              # free KV blocks, evictable cached ones included
    num_total_blocks: int             # KV blocks in all
    num_cached_blocks: int            # blocks reusable by prefix hash (in use or not)
    block_size: int                   # tokens per block
    num_held_blocks: int = 0          # blocks of finished sequences kept for a KV transfer (neither free nor leaked)
    num_spec_proposed_tokens: int = 0 # speculative drafts the target verified, over the worker's life
    num_spec_accepted_tokens: int = 0 # of those, accepted
    num_prompt_tokens: int = 0        # prompt tokens of sequences whose prefill completed, over the worker's life
    num_cached_prompt_tokens: int = 0 # of those, served by the prefix cache (the gateway's hit rate per endpoint)
    kv_tiers: tuple[KVTierLoad, ...] = ()   # the KV tiers below the device pool, fastest first
    num_kv_dropped_writes: int = 0    # evicted blocks not written down (the write queue was full)
    # A prompt token's compute, fitted from the engine's step times against their rows (None: not yet
    # measured; kept only with KV tiers, whose restore cost is priced against it).
    seconds_per_prompt_token: float | None = None
    weights: str = ""                 # the weights' fingerprint (backends/worker/fingerprint.py; "": none)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_prompt_tokens: int          # prompt tokens of sequences whose prefill completed
    num_cached_prompt_tokens: int   # of those, served by the prefix cache
    num_generation_tokens: int      # tokens sampled
    num_preemptions: int            # sequences sent back to recompute
    num_finished_sequences: int     # sequences ended for any reason
    num_failed_sequences: int       # sequences ended with an engine error
    num_steps: int                  # forward steps run
    num_spec_proposed_tokens: int = 0   # drafts the target verified
    num_spec_accepted_tokens: int = 0   # of those, accepted
    num_spec_verifications: int = 0     # sequence-steps that verified at least one draft
    speculative: str = ""               # the proposer's name ("" without speculation)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.num_spec_accepted_tokens / self.num_spec_proposed_tokens if self.num_spec_proposed_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
