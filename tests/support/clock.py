"""A clock that moves only when a test moves it, for the pure parts that take a `clock` callable."""
from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
