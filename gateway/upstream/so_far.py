"""What the client has of a streamed answer, choice by choice, over every leg so far: the records that
mid-stream failover reads a broken stream into and continues from (mid_stream_resume.py, text_batch.py).
Records only: no parsing, no bodies."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ChoiceSoFar:
    """What the client has of one choice of a streamed answer, over every leg so far."""
    text: str                            # output text sent
    token_ids: tuple[int, ...] | None    # its token ids, when every leg sent them (our workers)
    num_tokens: int                      # output tokens sent (token ids, else content events)
    finished: bool                       # a finish_reason was sent: the choice is whole
    calls: bool                          # tool calls were sent: text cannot continue it

    def then(self, later: ChoiceSoFar) -> ChoiceSoFar:
        """This, followed by what a continuation sent of the same choice."""
        ids = None if self.token_ids is None or later.token_ids is None else self.token_ids + later.token_ids
        return ChoiceSoFar(self.text + later.text, ids, self.num_tokens + later.num_tokens,
                           self.finished or later.finished, self.calls or later.calls)


@dataclass(frozen=True, slots=True)
class SoFar:
    """What the client has of a streamed answer, over every leg so far."""
    envelope: Mapping[str, Any]          # the first stream's id and created (the continuation's chunks get them)
    choices: tuple[ChoiceSoFar, ...]     # by index: every choice the request samples (n of each prompt)

    @property
    def finished(self) -> bool:
        """Every choice is whole."""
        return all(c.finished for c in self.choices)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def then(self, later: SoFar) -> SoFar:
        """This, followed by what a continuation sent."""
        return SoFar(self.envelope, tuple(a.then(b) for a, b in zip(self.choices, later.choices, strict=True)))

    def resume_token_ids(self) -> list[int] | list[list[int] | None] | None:
        """Our workers' `resume_token_ids` (backends/server/resume.py): one choice's tokens, or each choice's (null
        for a whole one); None when there is nothing to resume from (no token reached the client) or a leg did
        not send its token ids."""
        if any(c.token_ids is None for c in self.choices) or not self.num_tokens:
            return None
        if len(self.choices) == 1:
            return list(self.choices[0].token_ids or ())
        return [None if c.finished else list(c.token_ids or ()) for c in self.choices]
