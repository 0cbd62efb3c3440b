"""Verification of drafts: one target forward gave logits for a sequence's last token and each of its
K drafts; the sampler draws the target's own token at each of those K + 1 positions, and the drafts
are accepted up to the first that differs from it.

Position i is sampled exactly as plain decoding would sample output token n + i (n: tokens out so
far): with penalties and min_tokens computed over the outputs plus drafts[:i], and with the uniform
of (seed, n + i). A draft is a deterministic guess, so this is rejection sampling against a one-hot
draft distribution: draft i is accepted with the target's probability of it, and on a rejection
the token drawn is distributed as the target's distribution without the draft, renormalised. The
accepted tokens are therefore distributed exactly as the target's; greedy decoding and seeded
sampling give the very tokens plain decoding gives on the same logits.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.core.outputs import TokenLogprob
from backends.worker.sampler import SampleRow, sample


@dataclass(frozen=True, slots=True)
class Verified:
    token_ids: tuple[int, ...]                    # accepted drafts, then the target's own next token
    logprobs: tuple[TokenLogprob | None, ...]     # parallel to token_ids
    num_accepted: int                             # drafts accepted (len(token_ids) - 1)


def expand_rows(row: SampleRow, drafts: Sequence[int]) -> list[SampleRow]:
    """The K + 1 sampler rows of one sequence: row i sees drafts[:i] as already generated."""
    if not drafts:
        return [row]            # plain decoding: no copy of the outputs
    out = list(row.output_token_ids)
    return [SampleRow(row.params, row.seed, row.prompt_token_ids, out + list(drafts[:i]), row.eos_token_ids)
            for i in range(len(drafts) + 1)]


def verify(logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[Sequence[int]]) -> list[Verified]:
    """logits: [sum(len(d) + 1 for d in drafts), vocab], each sequence's rows consecutive (its last
    token's, then one per draft). rows[j], drafts[j]: sequence j's sampler row and drafts."""
    expanded = [r for row, d in zip(rows, drafts, strict=True) for r in expand_rows(row, d)]
    result = sample(logits, expanded)
    out: list[Verified] = []
    start = 0
    for d in drafts:
        tokens = result.token_ids[start:start + len(d) + 1]
        accepted = 0
        while accepted < len(d) and tokens[accepted] == d[accepted]:
            accepted += 1
        out.append(Verified(tuple(tokens[:accepted + 1]), tuple(result.logprobs[start:start + accepted + 1]),
                            accepted))
        start += len(d) + 1
    return out
