"""The rendezvous store, hosted by the caller on loopback, on a port nobody else has.

torch's default ("rank 0 hosts a TCPStore on MASTER_PORT") races for the port
between choosing and binding it, collides with stale processes on 29500, and
listens on every interface. Like torchrun's agent, we bind a socket to
127.0.0.1 port 0 *before* starting ranks, hand its fd to a ``TCPStore``
server, and start ranks with ``TORCHELASTIC_USE_AGENT_STORE=True`` so that
``init_process_group("env://")`` in every rank connects as a client.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

LOOPBACK = "127.0.0.1"


class RendezvousStore:
    """A TCPStore server for one run (on 127.0.0.1 unless ``host`` says otherwise: the Ray
    backend binds rank 0's node address); ``close()`` releases it."""

    # torch's own default for a store's waits (30 min): ranks that import for minutes still join.
    def __init__(self, world_size: int, timeout_s: float = 1800.0, host: str = LOOPBACK):
        import torch.distributed as dist  # the caller pays torch's import once per process

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(max(world_size, 8))
        self.port: int = listener.getsockname()[1]
        self._store: Any = dist.TCPStore(
            host,
            self.port,
            world_size,
            True,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        # The store owns the fd from here on and closes it when it is destroyed.
        listener.detach()

    def close(self) -> None:
        self._store = None  # the server stops and its socket closes when the store is freed
