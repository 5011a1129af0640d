"""One word of a fixed set (an outcome, a rank's state, a session's state): how such a word prints.

A ``str``, so JSON, comparisons with the plain word and ``"ready" in (...)`` work; printed,
formatted and put in an f-string it is the word itself (``failed``), never the enum's
``Outcome.FAILED``, on every Python we support.
"""

from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """The base of those enums (it has no members: each subclass names its words)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
