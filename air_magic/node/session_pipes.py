"""A persistent session's line to the ranks of one node (SPEC §15, docs/session.md).

Used by the local backend's loop (every rank) and by a Ray node's agent (that
node's ranks) alike. Before the ranks start, :meth:`SessionPipes.open` makes two
named pipes per rank in the call's private folder (``wire.session_fifo``):
``cmd`` (the number of the next cell, or "stop") and ``reply`` (the rank's
answer, one JSON line). Both ends of both stay open here, so no open blocks
and a rank never sees an end of file while its caller lives (the lifeline ends
it otherwise). A cell's payload is written once as ``cell-N.pkl``; each rank
writes ``cell-N-result-R.pkl`` or ``cell-N-error-R.pkl`` before it answers,
and :meth:`read` hands each answer back with those bytes, the files removed.
An interrupt of the cell is written on the command pipe before its SIGINT
(:meth:`mark_interrupt`): a rank that had not started the cell, and so ignored
the signal, finds it there as it starts the cell.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from typing import Any

from air_magic.protocol import wire


class SessionPipes:
    def __init__(self, call_dir: str, ranks: Iterable[int]):
        self.call_dir = call_dir
        self.ranks = list(ranks)
        self._cmd: dict[int, int] = {}  # rank -> our end of its command pipe
        self._reply: dict[int, int] = {}  # our end of a reply pipe -> rank
        self._pending: dict[int, bytes] = {}  # a reply pipe's unfinished line
        self._answers: dict[int, int] = {}  # cell -> how many ranks here answered it
        self._cell: int | None = None  # the last cell sent
        self._lock = threading.Lock()  # writes against close (a closed number may be reused at once)

    def open(self) -> list[int]:
        """Make both pipes of every rank; the reply pipes' descriptors, to watch for answers."""
        for rank in self.ranks:
            for direction in ("cmd", "reply"):
                os.mkfifo(wire.session_fifo(self.call_dir, direction, rank), 0o600)
            self._cmd[rank] = os.open(
                wire.session_fifo(self.call_dir, "cmd", rank), os.O_RDWR | os.O_NONBLOCK
            )
            reply = os.open(wire.session_fifo(self.call_dir, "reply", rank), os.O_RDWR | os.O_NONBLOCK)
            self._reply[reply] = rank
            self._pending[reply] = b""
        return list(self._reply)

    def send_cell(self, number: int, payload: bytes) -> None:
        """Cell ``number`` to every rank here: its payload once, then its number on each pipe."""
        wire.write_atomically(wire.session_cell_path(self.call_dir, number), payload)
        self._cell = number
        self._write({"cell": number})

    def send_stop(self) -> None:
        """Every rank here leaves its loop and ends like a call's rank."""
        self._write({"stop": True})

    def mark_interrupt(self, ranks: Iterable[int]) -> None:
        """Before SIGINT to these ranks: the cell it stops, on their command pipes. A rank still
        between cells ignores the signal (one that comes as a cell ends must not end the rank): if
        it has not started this cell yet, it reads this as it starts it and stops there; a rank
        that has finished the cell skips it."""
        if self._cell is not None:
            self._write({"interrupt": self._cell}, ranks)

    def _write(self, message: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        line = (json.dumps(message) + "\n").encode()
        with self._lock:
            to = self._cmd if ranks is None else {r: self._cmd[r] for r in ranks if r in self._cmd}
            for fd in to.values():
                try:
                    os.write(fd, line)  # a few bytes into an empty pipe: never blocks, never partial
                except OSError:
                    pass  # the session is ending: its loop says why

    def read(self, fd: int) -> list[tuple[int, dict[str, Any], bytes | None]]:
        """The answers waiting on a reply pipe: ``(rank, answer, result or error record bytes)``."""
        rank = self._reply[fd]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return []
        *lines, self._pending[fd] = (self._pending[fd] + data).split(b"\n")
        answers = []
        for line in lines:
            answer = json.loads(line)
            outcome = None
            if "cell" in answer:
                outcome = self._take_outcome(int(answer["cell"]), rank, bool(answer.get("ok")))
            answers.append((rank, answer, outcome))
        return answers

    def _take_outcome(self, number: int, rank: int, ok: bool) -> bytes | None:
        path = (wire.cell_result_path if ok else wire.cell_error_path)(self.call_dir, number, rank)
        data = wire.read_bytes(path)
        _unlink(path)
        self._answers[number] = self._answers.get(number, 0) + 1
        if self._answers[number] == len(self.ranks):  # every rank here has read it
            del self._answers[number]
            _unlink(wire.session_cell_path(self.call_dir, number))
        return data

    def close(self) -> None:
        with self._lock:
            for fd in [*self._cmd.values(), *self._reply]:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._cmd.clear()
            self._reply.clear()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
