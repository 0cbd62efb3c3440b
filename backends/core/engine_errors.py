"""Errors the engine raises to its callers. Pure: importable without torch or a model."""
from __future__ import annotations


class EngineRequestError(ValueError):
    """A request the engine refuses at once (prompt too long, duplicate id, bad parameters)."""
