"""A session stopped while a cell runs, restarted in a ``with`` block, ended by a cell's error
(issue 49's second probe): scripted ranks (backends/scripted.py) through the real session code."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

from air_magic.backends.scripted import Rank, ScriptedBackend
from air_magic.calls import cell_loop, persistent
from air_magic.calls.persistent import Session
from air_magic.errors import SessionEndedError
from air_magic.launch.settings import make_settings


def step(n):
    """Never runs: the session's cells are scripted."""


def _run_in_a_thread(session, number):
    """``session.run(step, number)`` on a thread of its own: (the thread, what it raised or returned)."""
    ended: dict[str, object] = {}

    def run():
        try:
            ended["value"] = session.run(step, number)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            ended["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, ended


def _wait_until_in_the_cell(session, number):
    for _ in range(2000):
        current = session.loop.current
        if current is not None and current.number == number:
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"cell {number} never started")


def test_a_stop_from_another_thread_interrupts_the_running_cell_first(session_of, capsys):
    cells = {1: [Rank(hangs=True), Rank(hangs=True)]}
    backend = ScriptedBackend([Rank(), Rank()], cells=cells)
    session = session_of(backend)
    thread, ended = _run_in_a_thread(session, 1)
    _wait_until_in_the_cell(session, 1)
    session.stop()
    thread.join(30)
    assert not thread.is_alive()
    err = capsys.readouterr()
    assert "a thread that is not a daemon" not in err.err, err.err  # was: blamed after a 10 s wait
    assert f"session {session.id}: cell 1 was running: its ranks get SIGINT" in err.err, err.err
    assert f"session {session.id} stopped; every rank is gone" in err.out
    assert backend.stops == []  # each rank left the cell on SIGINT, then its loop: none was killed
    error = ended["error"]
    assert isinstance(error, SessionEndedError), error
    assert str(error).startswith(f"session {session.id} was stopped while step ran"), error
    assert not session.alive()


def test_a_stop_while_a_rank_cannot_leave_its_cell_says_so_and_does_not_wait_out_its_time(session_of, capsys):
    cells = {1: [Rank(hangs=True, deaf_to_sigint=True), Rank(hangs=True)]}
    backend = ScriptedBackend([Rank(), Rank()], cells=cells)
    session = session_of(backend)
    thread, ended = _run_in_a_thread(session, 1)
    _wait_until_in_the_cell(session, 1)
    session.stop(wait_s=600)  # a rank deaf to SIGINT: stopped once RECOVER_S has passed, not at 600 s
    thread.join(30)
    assert not thread.is_alive()
    err = capsys.readouterr().err
    assert "a thread that is not a daemon" not in err, err
    assert (
        f"session {session.id}: rank(s) 0 did not leave cell 1 within {cell_loop.RECOVER_S:g} s of SIGINT"
        in err
    ), err
    assert isinstance(ended["error"], SessionEndedError) and backend.running() == []


def test_a_restart_in_a_with_block_is_stopped_at_the_blocks_end():
    backend = ScriptedBackend([Rank(), Rank()], cells={1: [Rank(returns=1), Rank(returns=2)]})
    settings = make_settings(num_accelerators=2, display="none", tracking=False)
    with Session(settings, backend=backend) as s:
        first = s.id
        assert s.restart() is s  # in place: the name the user holds is the new session
        assert s.id != first and s.alive() and persistent.active() is s
        assert s.run(step, 1) == [1, 2]
    assert not s.alive() and persistent.active() is None and backend.running() == []


def test_a_cell_error_that_ends_the_session_stays_the_ranks_end_in_its_record_and_status(session_of):
    """Rank 1 raises; rank 0 waits in a collective, deaf to SIGINT: the session ends. Its own
    run.json and status keep rank 1's error (was: both ranks "stopped by air_magic")."""
    cells = {1: [Rank(hangs=True, deaf_to_sigint=True), Rank(raises=ValueError("rank 1 gave up"))]}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells), tracking=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cell_loop, "RECOVER_S", 0.2)
        with pytest.raises(ValueError, match="rank 1 gave up"):
            session.run(step, 1)
    assert session.state == "ended"
    summary = json.loads(Path(session.log_dir, "run.json").read_text())
    assert summary["failed_rank"] == 1 and "rank 1 gave up" in summary["error"], summary
    assert summary["rank_states"] == {"0": "killed", "1": "failed"}, summary
    status = session.status()
    assert "rank 1: pid" in status and "raised in step (cell 1): ValueError: rank 1 gave up" in status, status


def test_a_session_not_started_says_how_to_start_it():
    session = Session(make_settings(num_accelerators=2, display="none", tracking=False))
    with pytest.raises(SessionEndedError, match=r"is not started: s.start\(\) starts it"):
        session.run(step, 1)


def test_a_rank_killed_in_a_cell_is_said_ended_by_its_signal_not_raised_in_the_cell(session_of):
    """Was: status said "raised in step (cell 1): SessionEndedError" of a rank SIGKILLed mid-cell
    (the "raised in" words are for a rank's own exception only)."""
    cells = {1: [Rank(hangs=True), Rank(killed_by=signal.SIGKILL)]}
    session = session_of(ScriptedBackend([Rank(), Rank()], cells=cells), tracking=False)
    with pytest.raises(SessionEndedError):
        session.run(step, 1)
    assert session.state == "ended"
    status = session.status()
    assert "raised in" not in status, status
    assert "rank 1: pid" in status and "SIGKILL" in status.split("rank 1: pid", 1)[1].splitlines()[0], status
