"""Fixtures of the unit tier's scripted sessions (backends/scripted.py)."""

from __future__ import annotations

import pytest

from air_magic.backends.scripted import ScriptedBackend
from air_magic.calls.persistent import Session
from air_magic.launch.settings import make_settings


@pytest.fixture
def session_of():
    """``session_of(backend, **settings)``: a started session on it, stopped at the test's end."""
    made: list[Session] = []

    def start(backend: ScriptedBackend, **settings) -> Session:
        settings = {"num_accelerators": 2, "display": "none", "tracking": False, **settings}
        session = Session(make_settings(**settings), backend=backend)
        made.append(session)
        return session.start()

    yield start
    for session in made:
        session.stop(quiet=True)
