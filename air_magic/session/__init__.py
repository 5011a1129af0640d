"""The call layer: the one place that picks a backend and wires consumers for a call.

This package is also what ``air_magic.session(...)`` calls (SPEC §15, a persistent
session): Python binds ``air_magic.session`` to this package as soon as any of its
modules is imported, so the package itself is made callable rather than shadowed.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, **settings: Any) -> Any:
        """``air_magic.session(**settings)``: a persistent session (see ``session/persistent.py``)."""
        from air_magic.session.persistent import session

        return session(**settings)


sys.modules[__name__].__class__ = _CallablePackage
