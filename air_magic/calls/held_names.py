"""What a persistent session's ranks hold of the notebook's, and what changed in the notebook since.

Used by ``calls/persistent.py`` for each cell. :class:`HeldNames` remembers,
for each name a cell bound in the ranks, the notebook's object then (and its
data fingerprint), so that the next cell sends it again only if the notebook
rebound it or changed it in place; the magic (``notebook/magics.py``) asks it
before it sends a name. :class:`CallerChanges` says where the notebook stands
now (its folder, ``sys.path`` and the environment's changes since the session
started), for the ranks to follow before each cell, as a one-off call's fresh
ranks would start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from air_magic.protocol import env_names, serialization

ABSENT = object()  # a name the notebook did not have when a cell bound it in the ranks
FINGERPRINT_LIMIT = 64 * 2**20  # bytes of pickle: a larger object held by the ranks is kept by identity


def digest(value: Any) -> bytes | None:
    """The value's data fingerprint (as one-off cells compare them), None when it cannot be taken:
    unpicklable, or larger than FINGERPRINT_LIMIT (a model: pickling it at every cell that reads it
    would cost more than the cell; its in-place changes in the notebook need ``--push NAME``)."""
    try:
        return serialization.fingerprint(value, limit=FINGERPRINT_LIMIT)
    except Exception:  # noqa: BLE001 - kept by identity alone, as before
        return None


class HeldNames:
    """name -> the notebook's object for it when a cell last bound it in the ranks (the copy that came
    back, the stale one a failed pull-back left, or ABSENT): not sent again while it is the same."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}
        self._digest: dict[str, bytes | None] = {}  # their data fingerprints then (None: not taken)

    def held_by_ranks(self, name: str, value: Any) -> bool:
        """The ranks have their own ``name``, and the notebook has neither rebound it since a cell bound
        it there nor changed it in place (``b.v = 100`` in the notebook: its data fingerprint
        differs, so the cell sends it again)."""
        if name not in self._held or self._held[name] is not value:
            return False
        taken = self._digest.get(name)
        return taken is None or digest(value) == taken

    def note(self, names: Mapping[str, Any]) -> None:
        """``name -> the notebook's value now`` for names a cell bound in the ranks (ABSENT: none)."""
        self._held.update(names)
        for name, value in names.items():
            self._digest[name] = None if value is ABSENT else digest(value)

    def forget(self, names: list[str]) -> None:
        for name in names:
            self._held.pop(name, None)
            self._digest.pop(name, None)

    def clear(self) -> None:
        """The notebook's objects are its own again (and not kept alive here)."""
        self._held.clear()
        self._digest.clear()


class CallerChanges:
    """Where the notebook stands now, for a session's ranks to follow before each cell."""

    def __init__(self, session_id: str, own_env: Mapping[str, str]):
        self.session_id = session_id
        self._own = set(own_env)  # the session's env=: the ranks keep it, as a one-off call's would
        self._at_start = dict(os.environ)  # each cell brings the changes since
        self._said: set[str] = set()  # names whose change the ranks do not follow, said once
        self._sent: set[str] = set()  # names a cell set in the ranks (unset there once gone here)

    def now(self) -> dict[str, Any]:
        """The notebook's folder, ``sys.path``, and its environment's changes since the session
        started, except the names the launcher gives each rank (said once, here)."""
        now = dict(os.environ)
        # A name sent once is sent every time (set back to its start value, the ranks must follow too).
        changed = {k: v for k, v in now.items() if self._at_start.get(k) != v or k in self._sent}
        removed = [k for k in {*self._at_start, *self._sent} if k not in now]
        self._sent.update(changed)
        kept = sorted(k for k in [*changed, *removed] if k in self._own or env_names.kept_by_the_ranks(k))
        for name in kept:
            if name not in self._said:
                self._said.add(name)
                print(
                    f"air_magic: the session's ranks keep their own {name} (set when the session "
                    "started); a one-off call, outside the session, takes the notebook's new value",
                    file=sys.stderr,
                )
        return {
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "env": {k: v for k, v in changed.items() if k not in kept},
            "unset": [k for k in removed if k not in kept],
        }
