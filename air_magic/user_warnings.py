"""Warnings that point at the user's line, not at air_magic's internals."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """Issue ``message`` attributed to the first frame outside this package.

    ``stacklevel`` is computed by walking the stack, because the number of
    air_magic frames between the user and here depends on the entry point
    (decorator, ``with_overrides``, cell magic).
    """
    level = 2  # stacklevel 2 is the frame that called this function
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
