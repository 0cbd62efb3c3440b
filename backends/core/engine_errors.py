"""Errors the engine raises to its callers. Pure: importable without torch or a model."""
from __future__ import annotations


class EngineRequestError(ValueError):
    """A request the engine refuses at once (prompt too long, duplicate id, bad parameters)."""


class EngineDeadError(RuntimeError):
    """The engine can never step again: a rank of its tensor-parallel group died or stopped answering. The
    worker answers 503 from then on (/health included); a restart is the way back."""
