"""`resume_token_ids`, the extension the gateway's mid-stream failover sends (docs/reliability.md): the output
tokens a client already has of an answer whose worker died, so this worker goes on after them. One sequence
takes an array of token ids; several (`n` > 1, a batch of prompts) take one entry per choice, in index order:
that choice's token ids (maybe none yet), or null for a choice the client has whole, which is not run again.
Parsing only: no engine.
"""
from __future__ import annotations

from typing import Any

from backends.server.errors import invalid_param
from backends.server.fields import is_int

Resumed = tuple[int, ...] | None   # one choice's output tokens the client has; None: it has the whole choice


def parse_resume_token_ids(ids: Any, vocab_size: int,
                           num_sequences: int) -> tuple[tuple[int, ...], tuple[Resumed, ...]]:
    """(one sequence's resumed tokens, each choice's of several); the one that does not apply is empty."""
    if ids is None:
        return (), ()
    if num_sequences == 1:
        one = _token_ids(ids, vocab_size)
        if one is None or not one:
            raise invalid_param("resume_token_ids",
                                f"`resume_token_ids` must be a non-empty array of token ids in [0, {vocab_size}).")
        return one, ()
    entries = [None if entry is None else _token_ids(entry, vocab_size) for entry in ids] \
        if isinstance(ids, list) else []
    if len(entries) != num_sequences or any(e is None for e, raw in zip(entries, ids, strict=True) if raw is not None) \
            or all(raw is None for raw in ids):
        raise invalid_param("resume_token_ids", f"`resume_token_ids` of {num_sequences} choices takes one entry per "
                            f"choice, in index order: an array of token ids in [0, {vocab_size}) (maybe empty), or "
                            "null for a choice that is whole; at least one is an array.")
    return (), tuple(entries)


def _token_ids(ids: Any, vocab_size: int) -> tuple[int, ...] | None:
    """`ids` as token ids; None when it is not an array of them."""
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        return None
    return tuple(ids)
