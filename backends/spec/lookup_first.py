"""Prompt lookup first, a model proposer where lookup finds nothing (`--speculative ngram+eagle`, `ngram+draft`).

Agents' output copies much of its context: a JSON with one field changed, code with a name replaced, a
quoted passage, a tool call's arguments. There prompt lookup drafts long runs for free. Where the text
is new it finds no match, and the model proposer (an EAGLE head, a draft model) drafts instead, so each
sequence gets the cheaper guess where one exists and a learned one elsewhere.

The model proposer sees every verified position (`observe`) whichever drafted, so its state never falls
behind; a pass of it runs only for the sequences lookup left without a draft. The engine keeps each
sequence's acceptance of lookup's drafts apart from the model's, and prices a lookup draft at its verify
rows only, so a copied run drafts as deep as lookup alone would, whatever the model costs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.spec.ngram import NgramProposer
from backends.spec.proposer import DraftRequest, Proposer


class LookupFirstProposer:
    def __init__(self, model: Proposer, lookup: NgramProposer) -> None:
        self.model, self.lookup = model, lookup
        self.name = f"{lookup.name}+{model.name}"
        self.cost_per_token = model.cost_per_token
        self.wants_hidden = model.wants_hidden
        self.num_lookup_drafts = 0      # requests that lookup answered
        self.num_model_drafts = 0       # requests passed on to the model proposer

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = self.look_up(requests)
        unmatched = [i for i, draft in enumerate(drafts) if not draft]
        if unmatched:
            for i, draft in zip(unmatched, self.propose_unmatched([requests[i] for i in unmatched]), strict=True):
                drafts[i] = draft
        return drafts

    def look_up(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Prompt lookup's drafts (empty where it finds no match). The engine calls this and
        `propose_unmatched` itself, to price lookup's drafts apart from the model's."""
        drafts = self.lookup.propose(requests)
        self.num_lookup_drafts += sum(1 for draft in drafts if draft)
        return drafts

    def propose_unmatched(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """The model proposer's drafts, for the requests lookup had nothing for."""
        self.num_model_drafts += len(requests)
        return self.model.propose(requests)

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        self.model.observe(request_id, start, token_ids, hidden)

    def free(self, request_id: str) -> None:
        self.lookup.free(request_id)
        self.model.free(request_id)
