"""Prompt lookup first, a model proposer where lookup finds nothing (`--speculative ngram+eagle`, `ngram+draft`).

Agents' output copies much of its context: a JSON with one field changed, code with a name replaced, a
quoted passage, a tool call's arguments. There prompt lookup drafts long runs for free. Where the text
is new it finds no match, and the model proposer (an EAGLE head, a draft model) drafts instead, so each
sequence gets the cheaper guess where one exists and a learned one elsewhere.

The model proposer sees every verified position (`observe`) whichever drafted, so its state never falls
behind; a pass of it runs only for the sequences lookup left without a draft. The adaptive K prices drafts
at the model proposer's cost, the dearer of the two.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.speculative.ngram import NgramProposer
from backends.speculative.proposer import DraftRequest, Proposer


class LookupFirstProposer:
    def __init__(self, model: Proposer, lookup: NgramProposer) -> None:
        self.model, self.lookup = model, lookup
        self.name = f"{lookup.name}+{model.name}"
        self.cost_per_token = model.cost_per_token
        self.wants_hidden = model.wants_hidden
        self.num_lookup_drafts = 0      # requests that lookup answered
        self.num_model_drafts = 0       # requests passed on to the model proposer

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = self.lookup.propose(requests)
        missing = [i for i, draft in enumerate(drafts) if not draft]
        if missing:
            for i, draft in zip(missing, self.model.propose([requests[i] for i in missing]), strict=True):
                drafts[i] = draft
        self.num_lookup_drafts += len(requests) - len(missing)
        self.num_model_drafts += len(missing)
        return drafts

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        self.model.observe(request_id, start, token_ids, hidden)

    def free(self, request_id: str) -> None:
        self.lookup.free(request_id)
        self.model.free(request_id)
