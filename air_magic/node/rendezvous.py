"""The rendezvous store, hosted for the caller on loopback, on a port nobody else has.

torch's default ("rank 0 hosts a TCPStore on MASTER_PORT") races for the port
between choosing and binding it, collides with stale processes on 29500, and
listens on every interface. Like torchrun's agent, we bind a socket to
127.0.0.1 port 0 *before* starting ranks, hand its fd to a ``TCPStore``
server, and start ranks with ``TORCHELASTIC_USE_AGENT_STORE=True`` so that
``init_process_group("env://")`` in every rank connects as a client.

Who runs the ``TCPStore`` server: with a warm starter, a fork of it
(:meth:`RendezvousStore.serve_in`; the starter has imported torch already, so the
caller, a kernel or ``air-magic run``, never imports torch at all: about 2 s of CPU
and 300 MB saved per caller process); otherwise the caller itself
(:meth:`RendezvousStore.serve_here`, importing torch once per process). Either way
the store outlives a dead rank, and ends with the call or with the caller.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import select
import signal
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from air_magic.node.warm import Starter

LOOPBACK = "127.0.0.1"
HOST_READY_S = 60.0  # a fork with torch makes the store in milliseconds; one importing torch, seconds
HOST_EXIT_S = 5.0  # after its lifeline closes, the host's exit (milliseconds), then SIGKILL


class RendezvousStore:
    """A TCPStore server for one call (on 127.0.0.1 unless ``host`` says otherwise: the Ray
    backend binds rank 0's node address); ``close()`` releases it.

    ``serve=False``: only the port is bound (ranks that connect wait in its backlog); the
    caller then calls :meth:`serve_in` or :meth:`serve_here` before starting ranks.
    """

    # torch's own default for a store's waits (30 min): ranks that import for minutes still join.
    def __init__(
        self, world_size: int, timeout_s: float = 1800.0, host: str = LOOPBACK, *, serve: bool = True
    ):
        self.host = host
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._listener: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(max(world_size, 8))
        self.port: int = self._listener.getsockname()[1]
        self._store: Any = None
        self._host_pidfd: int | None = None  # the starter's fork that serves it
        self._host_lifeline: int | None = None  # the write end: closing it ends the host
        if serve:
            self.serve_here()

    def serve_here(self) -> None:
        """Run the store's server in this process (imports torch: seconds, once per process)."""
        assert self._listener is not None, "the store is served already"
        # The store owns the fd it is given and closes it when it is destroyed: it gets a copy. A
        # Ctrl-C while the store is being made (torch may or may not own the copy by then) must not
        # leave this object closing an fd torch has closed, perhaps reused by another file since;
        # at worst the copy leaks until the process ends.
        given = os.dup(self._listener.fileno())
        self._store = tcp_store_server(self.host, self.port, self.world_size, self.timeout_s, given)
        self._listener.close()  # the store's copy serves the port
        self._listener = None

    def serve_in(self, starter: Starter, wait_s: float = HOST_READY_S) -> bool:
        """Have the warm starter fork the store's host, waiting up to ``wait_s`` for it to serve;
        False (nothing changed: the listener is still ours) if it could not."""
        assert self._listener is not None, "the store is served already"
        lifeline_r, lifeline_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pidfd = None
        served = False
        try:
            fds = [self._listener.fileno(), lifeline_r, ready_w]
            pid = starter.host_store(self.host, self.port, self.world_size, self.timeout_s, fds)
            # Opened before its lifeline can close: the host cannot exit (be reaped, its pid
            # reused) while we hold the pipe, so this pidfd is the host's.
            pidfd = os.pidfd_open(pid)
            os.close(ready_w)
            ready_w = -1
            served = _readable(ready_r, wait_s) and os.read(ready_r, 16) == b"ok"
        except OSError:
            pass
        finally:
            os.close(lifeline_r)
            os.close(ready_r)
            if ready_w >= 0:
                os.close(ready_w)
            if not served:  # it failed, timed out, or a Ctrl-C came: the host goes
                os.close(lifeline_w)
                if pidfd is not None:
                    _end_host(pidfd, 0)
        if not served:
            return False
        self._host_pidfd, self._host_lifeline = pidfd, lifeline_w
        self._listener.close()  # the host's copy serves it; ours would only keep the port bound
        self._listener = None
        return True

    def close(self) -> None:
        self._store = None  # the server stops and its socket closes when the store is freed
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._host_lifeline is not None:
            os.close(self._host_lifeline)  # EOF: the host exits
            self._host_lifeline = None
        if self._host_pidfd is not None:
            _end_host(self._host_pidfd, HOST_EXIT_S)
            self._host_pidfd = None


def tcp_store_server(host: str, port: int, world_size: int, timeout_s: float, listen_fd: int) -> Any:
    """torch's ``TCPStore`` server on an already listening socket (here, or in the starter's fork)."""
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def _readable(fd: int, timeout_s: float) -> bool:
    """``fd`` is readable within ``timeout_s`` (a pipe with data or at EOF; a pidfd whose process
    has exited). poll, not select(): the caller may hold more than 1,023 files."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _end_host(pidfd: int, grace_s: float) -> None:
    """Wait up to ``grace_s`` for the host (the starter's child, not ours: the starter reaps it and
    reports its exit) to exit, then SIGKILL it; closes ``pidfd``."""
    try:
        if not _readable(pidfd, grace_s):
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)
