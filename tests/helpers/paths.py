"""The repository's folders, found once: tests live one folder down by kind (tests/unit, ...)."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
REPO = TESTS.parent
PACKAGE = REPO / "air_magic"
EXAMPLES = REPO / "examples"
DOCS = REPO / "docs"


def script(name: str) -> str:
    """The path of a caller script in tests/helpers (run as its own process)."""
    return str(HELPERS / name)


FRAMEWORKS = TESTS / "process" / "frameworks"  # framework training files, run unchanged
