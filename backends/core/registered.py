"""A str enum whose members name where their implementation lives, `NAME = "name", "module:attribute"`: the
registry of an extension point is the enum its names are read into (docs/architecture.md, "Extension points").
The import of a member's target is the registry module's, in the implementations' own layer; nothing here
imports it."""
from __future__ import annotations

import enum
from typing import Self


class Registered(str, enum.Enum):
    target: str   # "module:attribute" of the member's implementation

    def __new__(cls, value: str, *target: str) -> Self:
        """A member, `NAME = "name", "module:attribute"`; a lookup by value, `Kind("name")`, never comes here
        (the enum's machinery answers it), though mypy checks it against this signature."""
        member = str.__new__(cls, value)
        member._value_ = value
        member.target = target[0]
        return member
