"""The controller's fence: at most one controller drives a queue at any moment.

straw's Coordinator trusts its caller to be the only owner of the journal. vime enforces that
with an exclusive, non-blocking ``flock`` on a file in the queue directory, held for the
controller's lifetime; the kernel releases it when the process dies, so a restarted controller
can take over a crashed one's queue, but a second live run on the same queue is refused.

A lock can outlive its holder where the file system keeps locks for its clients' sessions: on JuiceFS, a
flock taken through a client that died before its holder (a lost host, a killed mount) stays with that client's
session until JuiceFS expires the session (measured here: free 65 s after the volume was mounted again;
docs/juicefs.md). A holder known to be dead (the record names this host and a process that is gone) is
therefore waited out for up to :data:`STALE_HOLDER_WAIT_S`, saying so; a live holder, or one on another host
(whose liveness this host cannot see), is refused at once. The record names its process as the reaper's do
(pid and start time, ``vime.runtime.reaper.owner_alive``), so a reused pid is not taken for the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable

from vime.errors import UserError
from vime.runtime.reaper import owner_alive, process_start_time

STALE_HOLDER_WAIT_S = 180.0
RETRY_S = 2.0


class QueueBusy(UserError, RuntimeError):
    """Another live controller holds the queue (or a dead one's lock did not come free in time)."""


def holder_is_dead(holder: str) -> bool:
    """Whether the holder record (``{"host", "pid", "pid_start", ...}``) names a process of this host that is gone
    (no such process, a zombie, or its pid now another process's). An unreadable record, or one without
    ``pid_start`` (written before it was recorded), names no process for sure: the holder is taken as alive."""
    try:
        record = json.loads(holder)
        host, pid, pid_start = record["host"], int(record["pid"]), float(record["pid_start"])
    except (ValueError, KeyError, TypeError):
        return False
    return host == socket.gethostname() and not owner_alive(pid, pid_start)


class QueueFence:
    def __init__(self, fd: int, path: str):
        self._fd, self.path = fd, path

    @classmethod
    def acquire(
        cls, data_dir: str, *, stale_wait_s: float = STALE_HOLDER_WAIT_S, say: Callable[[str], None] = print
    ) -> QueueFence:
        os.makedirs(data_dir, exist_ok=True)
        path = os.path.join(data_dir, "controller.lock")
        deadline = None
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = ""
                try:
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                finally:
                    os.close(fd)
            if not holder_is_dead(holder):
                raise QueueBusy(
                    f"the queue in {data_dir} is driven by another live controller ({holder or 'unknown'}); "
                    "stop that run or use another --rollout-data-dir"
                )
            if deadline is None:
                deadline = time.monotonic() + stale_wait_s
                say(
                    f"the queue in {data_dir} is still locked for a controller that is gone ({holder}): waiting up "
                    f"to {stale_wait_s:.0f}s for the file system to release the lock (on JuiceFS: the session of "
                    "a client that died expires)"
                )
            if time.monotonic() >= deadline:
                raise QueueBusy(
                    f"the queue in {data_dir} is still locked for a controller that is gone ({holder}) after "
                    f"{stale_wait_s:.0f}s: its file system keeps the lock (on JuiceFS, for the session of a client "
                    "that died, until the session expires; docs/juicefs.md); retry later"
                )
            time.sleep(RETRY_S)
        pid = os.getpid()
        owner = json.dumps(
            {"host": socket.gethostname(), "pid": pid, "pid_start": process_start_time(pid), "since": time.time()}
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
