"""The controller's fence: at most one controller drives a queue at any moment.

straw's Coordinator trusts its caller to be the only owner of the journal. vime enforces that
with an exclusive, non-blocking ``flock`` on a file in the queue directory, held for the
controller's lifetime; the kernel releases it when the process dies, so a restarted controller
can take over a crashed one's queue, but a second live run on the same queue is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from vime.errors import UserError


class QueueBusy(UserError, RuntimeError):
    """Another live controller holds the queue."""


class QueueFence:
    def __init__(self, fd: int, path: str):
        self._fd, self.path = fd, path

    @classmethod
    def acquire(cls, data_dir: str) -> QueueFence:
        os.makedirs(data_dir, exist_ok=True)
        path = os.path.join(data_dir, "controller.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise QueueBusy(
                f"the queue in {data_dir} is driven by another live controller ({holder or 'unknown'}); "
                "stop that run or use another --rollout-data-dir"
            ) from None
        owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
