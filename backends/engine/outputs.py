"""What the engine hands back to the server after each step, one record per live sequence."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id, or (set by the server) a stop string
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
